"""runs/bench/host_pinning.py's refusals (its figures come from a GPU run only): one line and exit 2, nothing run."""
from __future__ import annotations

import pytest

from tests.support.bench import bench_script


@pytest.mark.parametrize("args, problem", [(["--repeats", "0"], "--repeats be at least 1"),
                                           (["--train-iters", "4"], "--train-iters must exceed 4"),
                                           (["--out", "{out}"], "already holds runs")])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, problem):
    (tmp_path / "earlier_run").mkdir()
    script = bench_script("host_pinning")
    assert script.main([a.format(out=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["earlier_run"]
