"""``--full-matrix`` runs every combination of the dims x schedule matrices (``make
test-all``); without it, tests marked ``full_matrix`` are deselected (not skipped), and the
representative subset that covers every code path runs (``make test``)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="run the whole dims x schedule matrix (tests marked full_matrix)",
    )


# Tests that run a zero-bubble schedule (tp_ext refuses them on a torch < 2.13, whose weight
# gradients there are wrong: tp_ext.pipeline.schedules.check_weight_split_supported; the refusal
# itself is tested on every torch). Where the schedule is not in the test id, every case runs one.
ZERO_BUBBLE_NAMES = ("ZeroBubble", "DualPipeV", "zbv", "dualpipev", "zero-bubble")
RUN_ZERO_BUBBLE = {
    "test_3d_training_matches_transformers": "id",
    "test_3d_training_matrix": "id",
    "test_trainer_resume_with_compression_is_bitwise": "id",
    "test_pipelined_save_is_the_whole_model": "id",
    "test_forward_under_pipelining_gives_transformers_logits": "id",
    "test_hf_pipeline_training_matches_transformers": "id",
    "test_hf_pipeline_training_matrix": "id",
    "test_resume_at_the_same_dims_is_bitwise": "id",
    "test_estimates_match_a_measured_training_step": "id",
    "test_two_nodes_on_one_host": "always",
    "test_zero_bubble_schedule_with_data_parallel_equals_the_reference": "always",
}


def _runs_zero_bubble(item) -> bool:
    how = RUN_ZERO_BUBBLE.get(getattr(item, "originalname", item.name))
    if how == "always":
        return True
    return how == "id" and any(n in item.name for n in ZERO_BUBBLE_NAMES)


def pytest_collection_modifyitems(config, items):
    from tp_ext.pipeline.schedules import weight_split_supported

    if not weight_split_supported():
        import torch

        skip = pytest.mark.skip(
            reason=f"runs a zero-bubble schedule, refused on torch {torch.__version__} (wrong "
            "weight gradients there; needs torch >= 2.13)"
        )
        for item in items:
            if _runs_zero_bubble(item):
                item.add_marker(skip)
    if config.getoption("--full-matrix"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("full_matrix") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def tp_ext_here(capsys):
    """``tp-ext ARGS`` run in this process, as one rank outside torchrun runs it: returns its exit
    status, stdout and stderr. For the single-process commands whose tests are about what they
    print and return, not about the process they run in (a fresh interpreter costs seconds)."""
    from tp_ext.cli import main

    def run(*argv):
        capsys.readouterr()
        try:
            status = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's refusals
            status = e.code
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """A token file for the training commands: byte-level tokens of real English text (this
    repository's README)."""
    from tp_ext.data import byte_tokens, write_token_file

    path = str(tmp_path_factory.mktemp("data") / "tokens.bin")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        write_token_file(path, byte_tokens(f.read()))
    return path


def pytest_runtest_logreport(report):
    """TP_EXT_FAILURE_LOG=FILE: each failure's traceback appended to FILE as it happens, so a run
    cut short (the GPU machine's time limit) still says why its failures failed."""
    path = os.environ.get("TP_EXT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
