"""Simulators and plots for planning and reading runs; no training run imports this package.

`timeline` predicts the steady-state step time of lock-step, locked-staleness and in-flight training;
`schedule_sim` plays a pipeline schedule on a per-rank event timeline (bubble, peak memory, Chrome
trace), `schedule_plot` draws it and `schedule_command` is `anytime schedule`. They import the runtime
packages (the schedules in `anytime.pipeline`), never the other way round: `tests/test_layout.py`
checks that no runtime module imports this package, and that a training run does not load it.
"""
