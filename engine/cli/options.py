"""Argument types and flags the command-line subcommands share."""

from __future__ import annotations

import argparse


def parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensor-parallel-size", type=positive_int, help="under torchrun: tensor parallel size"
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=positive_int,
        help="under torchrun: pipeline parallel size (data parallel takes the remaining ranks)",
    )
    parser.add_argument(
        "--expert-parallel-size",
        type=positive_int,
        help="under torchrun, mixture-of-experts models: ranks the experts are split over",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def parallel_overrides(args: argparse.Namespace) -> dict[str, int]:
    flags = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")
    return {flag: getattr(args, flag) for flag in flags if getattr(args, flag) is not None}
