"""The controller runtime: workqueues, rate limiters, clocks and metrics shared by all controllers."""
