"""A discrete-event simulator of a routed fleet, built from the real engine parts."""
