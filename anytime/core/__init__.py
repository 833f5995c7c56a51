"""Core utilities every layer may use: ranks and collectives (`dist`), sums and confidence
intervals (`stats`), typed dataclasses from plain data (`schema`), recipe files with inheritance
and overrides (`recipe_files`) and the watchdog that ends orphaned child processes (`watchdog`).
Nothing here imports another `anytime` package (only the top-level `errors` and `registry`)."""
