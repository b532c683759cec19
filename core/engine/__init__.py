"""The training engine: the loop (trainer), sampling and rollouts, the one learner loop, checkpoints, the watchdog."""
