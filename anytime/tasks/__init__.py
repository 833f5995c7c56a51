"""The tasks problems come from: the synthetic task (`synthetic`), the CPU testbed; reasoning-gym's
procedural tasks and their golds (`reasoning_gym`)."""
