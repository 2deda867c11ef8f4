"""Cost models (compute, communication, memory); the first arrives with the planner's issue."""
