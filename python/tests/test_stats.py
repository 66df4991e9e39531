"""Comm.stats() (toroid_comm_stats) across real processes: exact counts and bytes per row."""

import pathlib

from launch import assert_all_passed, run_ranks

WORKER = pathlib.Path(__file__).with_name("stats_worker.py")


def test_stats_count_exactly_on_2_ranks():
    assert_all_passed(run_ranks(2, WORKER, timeout=120), "stats passed")
