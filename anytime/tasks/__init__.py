"""The synthetic task (`synthetic`) and the tiny models trained on its text (`tiny`): the CPU testbed;
reasoning-gym's procedural tasks and their golds (`procedural`)."""
