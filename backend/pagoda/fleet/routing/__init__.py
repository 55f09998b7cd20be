"""The routing decision: router, policies, routing-time affinity, replica membership."""
