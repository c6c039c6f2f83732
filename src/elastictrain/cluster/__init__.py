"""Every Ray call: reservations, actors, calls and gathers with typed errors."""
