"""``--full-matrix`` runs every combination of the layout x schedule matrices (``make
test-all``); without it, tests marked ``full_matrix`` are deselected (not skipped), and the
representative subset that covers every code path runs (``make test``)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="run the whole layout x schedule matrix (tests marked full_matrix)",
    )


def pytest_collection_modifyitems(config, items):
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
