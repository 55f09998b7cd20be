"""The router's front gate: input limits, API keys and tenants, rate limits, overload memory."""
