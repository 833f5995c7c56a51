"""The one entry point: `anytime train | sft | eval | export | serve | schedule | config | tiny-model`.

Each subcommand parses its own flags and hands over to the module that owns the concept; heavy
modules are imported only by the subcommand that needs them, so `anytime config` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from anytime.config import RecipeError


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (see recipes/; every key: docs/recipes.md)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8 budget.prior=uniform")


def _cmd_config(args: argparse.Namespace) -> int:
    from anytime.config import load_recipe, recipe_reference

    if args.reference:
        print(recipe_reference(), end="")
        return 0
    if args.recipe is None:
        raise RecipeError("give a recipe (e.g. recipes/quickstart.yaml) or --reference")
    recipe = load_recipe(args.recipe, args.overrides)
    print(recipe.to_yaml(), end="")
    grid = recipe.budget.grid()
    print(f"# budgets: {grid}  prior: {[round(p, 4) for p in recipe.budget.prior_probs()]}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from anytime.trainer.launch import Nodes, launch_train

    return launch_train(args.recipe, args.overrides, Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint))


def _cmd_sft(args: argparse.Namespace) -> int:
    from anytime.trainer.launch import launch_sft

    return launch_sft(args.recipe, args.overrides)


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from anytime.tasks import synthetic
    from anytime.models.tiny import build_tiny_model

    path = build_tiny_model(args.out, synthetic.corpus(), arch=args.arch, hidden_size=args.hidden_size,
                            num_layers=args.layers, seed=args.seed)
    print(f"tiny model written to {path}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from anytime.serving.export import serving_folder
    from anytime.serving import serve

    args.path = str(serving_folder(Path(args.path)))   # a run folder: its newest checkpoint, exported
    return serve.run(args)


def _cmd_schedule(args: argparse.Namespace) -> int:
    from anytime.analysis import schedule_command as command

    return command.run(args)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; `command` (the subcommand about to run, if known) spares the other commands'
    optional modules: `anytime train` never loads the schedule simulator (`anytime.analysis`)."""
    parser = argparse.ArgumentParser(prog="anytime", description="RL fine-tuning for anytime reasoning (BRPO).")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="print a recipe fully resolved (defaults + file + overrides)",
                       epilog="Every recipe key, its type, default, allowed values and meaning: docs/recipes.md "
                              "(`anytime config --reference` prints it).")
    p.add_argument("recipe", nargs="?", default=None, help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8 budget.prior=uniform")
    p.add_argument("--reference", action="store_true", help="print the reference of every recipe key (markdown)")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("train", help="run a recipe: optional SFT warm start, then anytime RL")
    _add_recipe_args(p)
    p.add_argument("--nnodes", type=int, default=1, help="learner nodes (run `anytime train` on each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank among --nnodes")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, the same on every node")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sft", help="run only the supervised warm start of a recipe")
    _add_recipe_args(p)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("tiny-model", help="build a tiny random model + tokenizer for tests and the CPU quickstart")
    p.add_argument("out")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_tiny_model)

    from anytime.serving import serve

    p = sub.add_parser("serve", help=serve.__doc__.strip().splitlines()[0])
    serve.add_arguments(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("schedule", help="show, simulate and compare pipeline schedules")
    p.set_defaults(func=_cmd_schedule)
    if command in (None, "schedule"):
        from anytime.analysis import schedule_command

        schedule_command.add_arguments(p)

    for name, module in (("eval", "anytime.evaluation.evaluate"), ("export", "anytime.serving.export"),
                         ("doctor", "anytime.doctor")):
        try:
            mod = __import__(module, fromlist=["add_arguments"])
        except ImportError:
            continue
        p = sub.add_parser(name, help=mod.__doc__.strip().splitlines()[0] if mod.__doc__ else name)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        return int(args.func(args) or 0)
    except (RecipeError, ValueError, FileNotFoundError) as exc:
        # Bad input: say what to change, no traceback (use -v for one).
        if args.verbose:
            raise
        print(f"anytime {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"anytime {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
