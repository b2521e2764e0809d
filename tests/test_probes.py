from benchmarks.probes import command_buffer_updates, pass_times, spy_top


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


def test_command_buffer_updates_counts_re_records_per_buffer_in_both_spellings():
    lines = [  # jaxlib 0.11.2's spelling, then XLA head's
        "I1204 command_buffer_thunk.cc:270] Initialized command buffer on device #0 in 9000 \u03bcs; num_commands=835",
        "I1204 command_buffer_thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd sequence after 1"
        " executions since last update; num_commands=835; updated_allocs=4; is_first_record=false; needs_update=true",
        "I1204 command_buffer_thunk.cc:362] [0] Updated command buffer in 1100 \u03bcs; num_commands=835",
        "I1204 command_buffer_thunk.cc:250] Update command buffer on device #0 by recoding command buffer cmd sequence after 3"
        " executions since last update; num_commands=835; updated_allocs=10",
        "I1204 command_buffer_thunk.cc:270] Updated command buffer in 900 \u03bcs; num_commands=835",
        "I1204 command_buffer_thunk.cc:336] [0] Create/Update command buffer by recoding command buffer cmd sequence after 1"
        " executions since last update; num_commands=40; updated_allocs=2; is_first_record=false; needs_update=true",
    ]
    per_buffer = command_buffer_updates.summarise(lines)
    assert per_buffer[835]["updates"] == 2 and per_buffer[835]["update_us"] == 2000
    assert per_buffer[835]["initializations"] == 1 and per_buffer[835]["initialize_us"] == 9000
    assert per_buffer[835]["moved_allocs"] == {4: 1, 10: 1} and per_buffer[835]["runs_between"] == {1: 1, 3: 1}
    assert per_buffer[40]["updates"] == 1 and per_buffer[40]["update_us"] == 0


def test_command_buffer_updates_refuses_a_log_without_its_lines(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text("nothing here\n")
    assert command_buffer_updates.main(["command_buffer_updates.py", str(log)]) == 2
    assert "no command_buffer_thunk lines" in capsys.readouterr().err
