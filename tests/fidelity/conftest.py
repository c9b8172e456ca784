import pytest

# (error, cell) pairs gathered by the accuracy tests; the worst is printed at the end of the run.
ERRORS: list[tuple[float, str]] = []


@pytest.fixture
def record_error():
    def record(error: float, cell: str) -> None:
        ERRORS.append((error, cell))

    return record


def pytest_terminal_summary(terminalreporter):
    if ERRORS:
        error, cell = max(ERRORS, key=lambda e: abs(e[0]))
        terminalreporter.write_line(f"fidelity: worst predicted-vs-measured error {error:+.2%} ({cell}), "
                                    f"{len(ERRORS)} figures checked")
