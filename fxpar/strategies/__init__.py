"""Per-op sharding strategy rules, one file per op family (issue: planner)."""
