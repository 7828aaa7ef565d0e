"""``--full-matrix`` runs every combination of the layout x schedule matrices (``make
test-all``); without it, tests marked ``full_matrix`` are deselected (not skipped), and the
representative subset that covers every code path runs (``make test``)."""


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
