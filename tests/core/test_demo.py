"""``prefixcache demo`` prints the design's worked example exactly, and tells the truth
about eviction under the other policies."""

from __future__ import annotations

import pytest

from prefixcache.core import EVICTION_POLICIES
from prefixcache.entrypoints.cli import main
from tests.data_paths import REPO_ROOT


def run_demo(capsys, *argv: str) -> list[str]:
    assert main(["demo", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_default_demo_is_the_designs_example(capsys):
    lines = run_demo(capsys)
    text = "\n".join(lines)
    # Time 4 and 5: the design's free queue; Time 6: its allocation, evicting block 3
    assert "free queue (head first): 7 - 8 - 9 - 4 - 3 - 2\n" in text
    assert "free queue (head first): 7 - 8 - 9 - 4 - 3 - 2 - 6 - 5 - 1 - 0" in text
    assert "request1 (14 tokens, first 10 shared) hits 8 tokens" in text
    time6 = lines.index(next(line for line in lines if line.startswith("Time 6")))
    assert lines[time6].endswith("hits 12 tokens; the rest comes from the queue head, "
                                 "evicting cached block 3")
    assert lines[time6 + 1] == "  request2 block table: [0, 1, 2, 7, 8, 9, 4, 3]"
    assert lines[time6 + 3] == "  free queue (head first): 6 - 5"


@pytest.mark.parametrize("policy", sorted(set(EVICTION_POLICIES) - {"lru"}))
def test_other_policies_report_what_they_evicted(capsys, policy):
    lines = run_demo(capsys, "--policy", policy)
    time4 = next(line for line in lines if line.startswith("Time 4"))
    assert "join the tail" not in time4 and f"placed by the {policy} policy" in time4
    time6 = lines.index(next(line for line in lines if line.startswith("Time 6")))
    table = [int(x) for x in lines[time6 + 1].split(": ")[1].strip("[]").split(", ")]
    cached_at_5 = lines[time6 - 2].split(": ")[1].strip("[]").split(", ")
    evicted = [b for b in table[3:] if str(b) in cached_at_5]
    if evicted:
        assert f"evicting cached block{'s' if len(evicted) > 1 else ''} " \
               f"{', '.join(map(str, evicted))}" in lines[time6]
    else:
        assert lines[time6].endswith("evicting nothing cached")


def test_help_names_the_design_document(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert '"Automatic Prefix Caching"' in text
    assert "docs/design.md" in text
    assert (REPO_ROOT / "docs" / "design.md").is_file()
