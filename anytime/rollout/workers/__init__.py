"""Where rollouts run and how they reach the trainer: one worker (`worker`: an engine, a verifier and the
anytime rollout), the placements (`placement`, `local`: in the learner processes; `pool`, `processes`,
`ray_workers`: in processes of their own), the wire format between processes (`wire`), the devices and
cores each worker takes (`devices`), in-flight weights (`inflight`) and dynamic sampling
(`dynamic_sampling`)."""
