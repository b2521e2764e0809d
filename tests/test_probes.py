from benchmarks.probes import pass_times, spy_top


def test_pass_times_sums_each_pass_over_its_runs():
    lines = [
        "I1203 hlo_pass_pipeline.cc:206] HLO pass: dce time: 10 us (10 us) (cumulative: 10 us)",
        "I1203 hlo_pass_pipeline.cc:211]   HLO pass copy-insertion",
        "I1203 hlo_pass_pipeline.cc:206] HLO pass: copy-insertion time: 2500 us (2500 us)",
        "I1203 hlo_pass_pipeline.cc:206] HLO pass: dce time: 30 us (40 us)",
    ]
    total, runs = pass_times.pass_times(lines)
    assert total == {"dce": 40, "copy-insertion": 2500}
    assert runs == {"dce": 2, "copy-insertion": 1}


def test_pass_times_refuses_a_log_without_pass_lines(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("nothing here\n")
    assert pass_times.main(["pass_times.py", str(log)]) == 2
    assert "no 'HLO pass" in capsys.readouterr().err


def test_spy_top_counts_a_frame_once_per_stack_and_the_leaf_as_self():
    lines = [
        "<module> (a.py:1);compile (b.py:2);llvm::Pass;llvm::Pass 6\n",  # a recursive frame counts once
        "<module> (a.py:1);lower (c.py:3) 4\n",
        "not a stack line\n",
    ]
    inclusive, leaf, total = spy_top.frame_counts(lines)
    assert total == 10
    assert inclusive == {"<module>": 10, "compile": 6, "llvm::Pass": 6, "lower": 4}
    assert leaf == {"llvm::Pass": 6, "lower": 4}
