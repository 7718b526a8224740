"""Run-time pieces of fxpar: collectives, resharding execution, schedules."""
