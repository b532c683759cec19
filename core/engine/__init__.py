"""The training engine: the loop (trainer), rollouts, the one learner loop, checkpoints, the watchdog, checked rewards."""
