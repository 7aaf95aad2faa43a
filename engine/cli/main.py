"""Command line: ``python -m engine demo | train | matrix`` (see ``--help`` of each)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from engine.cli.demo.settings import ALGORITHMS, algorithm_names
from engine.cli.loggers import DEFAULT_LOGGERS, logger_flag, resolve_loggers
from engine.cli.options import non_negative_int, parallel_flags, parallel_overrides, positive_int
from engine.cli.train import DEFAULT_LR, train
from engine.config import EngineConfig
from engine.losses.registries import POLICY_LOSSES
from engine.losses.rollout_correction import LEVELS, MODES
from heads.errors import ConfigError, EngineError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    matrix = commands.add_parser(
        "matrix", help="list every head x backend x device cell and whether it runs here"
    )
    matrix.add_argument("--json", action="store_true", help="machine-readable output")
    demo = commands.add_parser(
        "demo",
        help="RL (PPO, GRPO, RLOO, REINFORCE++) of an actor on a rule-rewarded task",
        description="PPO (actor, critic, reference) or a critic-free algorithm (actor, reference) "
        "on the parity task (see engine/cli/demo/); writes metrics.jsonl, metrics.png, "
        "checkpoints and, at the end, the trained models as Hugging Face directories "
        "(huggingface/actor, ...) to --output-dir. Ctrl-C saves and exits; --resume goes on.",
    )
    demo.add_argument("--config", help="YAML file with demo and engine settings (flags win)")
    demo.add_argument(
        "--algorithm",
        help="ppo (GAE with a critic); grpo, rloo, reinforce_pp (REINFORCE++ with a group-mean "
        "baseline), each sampling a group of responses per prompt; or any advantage estimator "
        f"by name: {', '.join(algorithm_names()[len(ALGORITHMS) :])} (default ppo)",
    )
    demo.add_argument(
        "--policy-loss",
        help="the actor's policy loss by name (vanilla is PPO's clip): "
        f"{', '.join(POLICY_LOSSES.names())}; its options go in the config file "
        "(ppo.policy_options) (default vanilla)",
    )
    demo.add_argument(
        "--model",
        help="model preset for every role (tiny, small, moe) or a Hugging Face checkpoint "
        "directory (default tiny)",
    )
    demo.add_argument(
        "--router-replay",
        action="store_true",
        help="mixture-of-experts actors: record each token's experts at the old-log-prob pass "
        "and route the updates the same way",
    )
    demo.add_argument(
        "--lora-rank",
        type=positive_int,
        help="train the actor (and PPO's critic, with its value layer) as LoRA adapters of "
        "this rank; the actor's reference is then the actor with the adapters off (one engine "
        "for both)",
    )
    demo.add_argument(
        "--lora-alpha",
        type=float,
        help="LoRA alpha, the scale being alpha / rank (default the rank)",
    )
    demo.add_argument("--device", help="cpu, cuda, npu or auto (default auto)")
    demo.add_argument("--backend", help="backend name (default megatron)")
    demo.add_argument("--steps", type=positive_int, help="iterations (default 120)")
    demo.add_argument("--seed", type=non_negative_int, help="random seed (default 0)")
    demo.add_argument(
        "--output-dir",
        help="where metrics, plot, checkpoints and the final Hugging Face directories go "
        "(default demo-output)",
    )
    demo.add_argument(
        "--resume", action="store_true", help="continue the run in --output-dir from its checkpoint"
    )
    demo.add_argument(
        "--rollout-correction",
        choices=LEVELS,
        help="weight the policy loss by pi_old / pi_rollout (the generator's log-probs of the "
        "sampled tokens) per token, sequence or geometric mean (ppo.rollout_correction.level); "
        "any --rollout-correction-* flag turns the correction on (default token)",
    )
    demo.add_argument(
        "--rollout-correction-mode",
        choices=MODES,
        help="truncate: cap the weights at the upper bound (TIS); mask: drop the tokens or "
        "sequences whose weight is outside [lower, upper] (default truncate)",
    )
    demo.add_argument(
        "--rollout-correction-upper", type=float, help="the cap, or the upper bound (default 2)"
    )
    demo.add_argument(
        "--rollout-correction-lower",
        type=float,
        help="mask mode: the lower bound (default 1 / upper)",
    )
    logger_flag(demo, default=",".join(DEFAULT_LOGGERS))
    parallel_flags(demo)
    engine_defaults = attrs.fields(EngineConfig)
    train = commands.add_parser(
        "train",
        help="train one engine (SFT or value regression) on synthetic data or a JSON-lines file",
        description="One engine trained with the built-in SFT (--head lm) or value-regression "
        "(--head value) loss, on synthetic data or --data FILE.jsonl: tokenized records, or text, "
        "prompt/response and chat records tokenized by the --model directory's tokenizer. With "
        "--output-dir it writes metrics.jsonl, metrics.png and the final model as a Hugging Face "
        "directory (OUTPUT_DIR/huggingface).",
    )
    train.add_argument(
        "--head", default="lm", help="head name: lm, value, or a plugin's (default %(default)s)"
    )
    train.add_argument("--backend", default="megatron", help="backend name (default %(default)s)")
    train.add_argument(
        "--device", default="auto", help="cpu, cuda, npu or auto (default %(default)s)"
    )
    train.add_argument("--config", help="YAML file with EngineConfig settings (flags win)")
    train.add_argument(
        "--model",
        help="model preset (tiny, small, moe) or a Hugging Face checkpoint directory, whose "
        "tokenizer reads text --data (default tiny); overrides the config file",
    )
    train.add_argument(
        "--steps", type=positive_int, default=20, help="optimizer steps (default %(default)s)"
    )
    train.add_argument(
        "--batch-size",
        type=positive_int,
        default=16,
        help="sequences per step (default %(default)s)",
    )
    train.add_argument(
        "--max-length",
        type=positive_int,
        default=64,
        help="longest synthetic sequence (default %(default)s)",
    )
    train.add_argument(
        "--micro-batch-size",
        type=positive_int,
        help=f"sequences per micro-batch (default {engine_defaults.micro_batch_size.default})",
    )
    train.add_argument(
        "--max-tokens-per-micro-batch", type=positive_int, help="plan micro-batches by token budget"
    )
    train.add_argument(
        "--packing",
        action="store_true",
        default=None,
        help="pack each micro-batch's sequences back to back in one row (no padding computed)",
    )
    train.add_argument(
        "--data",
        help="JSON lines of one kind: {input_ids, returns (--head value), loss_mask (optional)}, "
        "or for --head lm {text}, {prompt, response} or {messages: [{role, content}, ...]}",
    )
    train.add_argument(
        "--output-dir",
        help="write metrics.jsonl, metrics.png, the loggers' files and the final model "
        "(huggingface/) here",
    )
    logger_flag(train, default=f"{DEFAULT_LOGGERS[0]}, and {DEFAULT_LOGGERS[1]} with --output-dir")
    train.add_argument("--lr", type=float, help=f"peak learning rate (default {DEFAULT_LR})")
    train.add_argument(
        "--seed", type=int, help=f"random seed (default {engine_defaults.seed.default})"
    )
    parallel_flags(train)
    return parser


def demo(args: argparse.Namespace) -> int:
    from engine.cli import demo as ppo_demo

    overrides: dict[str, Any] = {
        key: getattr(args, key)
        for key in ("algorithm", "device", "backend", "steps", "seed", "output_dir")
        if getattr(args, key) is not None
    }
    engine: dict[str, Any] = {}
    if args.model is not None:
        engine["model"] = args.model
    parallel = parallel_overrides(args)
    if parallel:
        engine["parallel"] = parallel
    if engine:
        overrides["engine"] = engine
    actor: dict[str, Any] = {}
    if args.router_replay:
        actor["router_replay"] = True
    correction = {
        setting: getattr(args, flag)
        for setting, flag in (
            ("level", "rollout_correction"),
            ("mode", "rollout_correction_mode"),
            ("upper", "rollout_correction_upper"),
            ("lower", "rollout_correction_lower"),
        )
        if getattr(args, flag) is not None
    }
    ppo: dict[str, Any] = {}
    if correction:
        ppo["rollout_correction"] = correction
    if args.policy_loss is not None:
        ppo["policy_loss"] = args.policy_loss
    if ppo:
        overrides["ppo"] = ppo
    if args.lora_alpha is not None and args.lora_rank is None:
        raise ConfigError("--lora-alpha needs --lora-rank")
    if args.lora_rank is not None:
        lora: dict[str, float] = {"rank": args.lora_rank}
        if args.lora_alpha is not None:
            lora["alpha"] = args.lora_alpha
        actor["lora"] = lora
        overrides["critic"] = {"lora": lora}  # built only when the algorithm reads values
    if actor:
        overrides["actor"] = actor
    if args.logger is not None:
        overrides["loggers"] = args.logger
    config = ppo_demo.resolve_config(args.config, overrides, args.resume, args.output_dir)
    loggers = resolve_loggers(config.loggers, config.output_dir)
    try:
        summary = ppo_demo.run(config, resume=args.resume, loggers=loggers)
    except ppo_demo.Interrupted as stopped:
        print(
            f"interrupted after iteration {stopped.iteration} (saved); continue with: "
            f"python -m engine demo --resume --output-dir {config.output_dir}",
            file=sys.stderr,
        )
        return 130
    if summary.get("iterations") and _is_lead_rank():
        print(
            f"mean reward: first {summary['window']} iterations "
            f"{summary['first_reward']:.3f}, last {summary['window']} "
            f"{summary['last_reward']:.3f}",
            flush=True,
        )
    return 0


def _is_lead_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def show_matrix(as_json: bool) -> int:
    from engine.cli.matrix import backend_abilities, cells, text_report, versions

    rows, installed, backends = cells(), versions(), backend_abilities()
    if as_json:
        report = {"cells": rows, "backend_abilities": backends, "versions": installed}
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(text_report(rows, backends, installed)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return train(args)
        if args.command == "demo":
            return demo(args)
        if args.command == "matrix":
            return show_matrix(args.json)
    except EngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1
