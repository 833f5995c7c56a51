"""Core utilities every layer may use: ranks and collectives (`dist`), sums and confidence intervals
(`stats`), the device's precision (`precision`) and the watchdog that ends orphaned child processes
(`watchdog`). Nothing here imports another `anytime` package (only the top-level `errors`, `registry` and
`defaults`); the recipe and what is derived from it live in `anytime.config`."""
