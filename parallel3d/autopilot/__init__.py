"""The autopilot: measure the running job, fit the planner's terms, move to a faster layout."""
