"""The longest test files first: pytest-xdist (--dist loadfile --no-loadscope-reorder, in
pyproject.toml) hands files out in collection order, and a long file handed out last would run
alone while the other worker sits idle (by default xdist puts the files with the fewest tests,
here the student versions, last)."""

LONGEST_FIRST = ("test_student_chapters_00_06", "test_student_chapters_07_09", "test_elastic",
                 "test_student_chapters_10_on", "test_train_ft", "test_multinode", "test_restarts",
                 "test_train_ddp")


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
