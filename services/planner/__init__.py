"""The planner: reads every service's rates and rewrites replica counts (DESIGN.md section 4)."""
