from batchserve.cli import main
from batchserve.entrypoints.engine_args import engine_config_from_args
from batchserve.entrypoints.generate import build_generate_parser


def test_generate_parser_takes_prompts_sampling_and_engine_flags():
    args = build_generate_parser().parse_args(
        ["Hello", "--max-tokens", "8", "--temperature", "0.5", "--seed", "3", "--max-batch-size", "4"]
    )
    assert args.prompts == ["Hello"] and args.max_tokens == 8 and args.seed == 3
    assert engine_config_from_args(args, model=args.model).scheduler.max_batch_size == 4


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_generate_checks_its_arguments_before_the_model_loads(monkeypatch, capsys):
    import pytest

    from batchserve.entrypoints import generate
    from batchserve.entrypoints.llm import LLM

    def no_model(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(LLM, "from_config", no_model)
    for argv, words in [
        (["hi", "--max-tokens", "0"], "max_tokens must be in [1, inf], got 0"),
        (["hi", "--temperature", "-1"], "temperature"),
        (["", "--max-tokens", "4"], "a prompt is empty"),
        (["hi", "--block-size", "4"], "block_size must be in [8, 128]"),
    ]:
        with pytest.raises(SystemExit) as exc:
            generate.main(argv)
        assert exc.value.code == 2 and words in capsys.readouterr().err, argv


def test_generate_leaves_the_kv_pool_to_the_offline_llm_unless_told():
    from batchserve.entrypoints.generate import build_generate_parser, prepare

    parser = build_generate_parser()
    config, params = prepare(parser.parse_args(["Write a haiku.", "--max-tokens", "48"]), ["Write a haiku."])
    # unset: LLM.from_config sizes the pool to the tokenized prompts (tests/engine/test_kv_pool_sizing.py)
    assert config.cache.num_kv_blocks is None and config.cache.kv_cache_memory_fraction is None
    assert params.max_tokens == 48
    config, _ = prepare(parser.parse_args(["x", "--num-kv-blocks", "500"]), ["x"])
    assert config.cache.num_kv_blocks == 500
    config, _ = prepare(parser.parse_args(["x", "--kv-cache-memory-fraction", "0.1"]), ["x"])
    assert config.cache.num_kv_blocks is None and config.cache.kv_cache_memory_fraction == 0.1


def test_serve_reports_a_bad_config_file_without_a_traceback(tmp_path, capsys):
    import json

    import pytest

    from batchserve.entrypoints.openai.launch import main as serve_main

    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"max_batch_size": "eight"}))
    with pytest.raises(SystemExit) as exc:
        serve_main(["--config", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'max_batch_size'" in err and "'eight'" in err and "Traceback" not in err


def test_the_cli_sends_tune_to_the_measured_or_the_simulated_search(capsys):
    """`tune --simulate` is the simulator's search (its own flags); bench's measured tune refuses it, so that bench
    never has to import the simulator."""
    import pytest

    from batchserve.bench import tune

    with pytest.raises(SystemExit) as exc:
        main(["tune", "--simulate", "--help"])
    simulated = capsys.readouterr().out
    assert exc.value.code == 0 and "batchserve tune --simulate" in simulated and "--replicas-list" in simulated
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    assert "--replicas-list" not in capsys.readouterr().out
    assert tune.main(["--simulate"]) == 2 and "batchserve tune --simulate" in capsys.readouterr().err


def test_a_mistyped_command_gets_a_suggestion(capsys):
    assert main(["genrate"]) == 2
    assert "did you mean 'generate'?" in capsys.readouterr().err


def test_every_flag_of_every_command_has_help_and_shows_its_default():
    from batchserve.bench.cli import build_parser as bench_parser
    from batchserve.bench.tune import build_parser as tune_parser
    from batchserve.entrypoints.generate import build_generate_parser
    from batchserve.entrypoints.openai.launch import make_parser

    for parser in (build_generate_parser(), make_parser(), bench_parser(), tune_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and action.help != "show this help message and exit":
                text = formatter._get_help_string(action)
                assert action.help, (parser.prog, action.option_strings)
                if action.default not in (None, False):
                    assert "default" in text, (parser.prog, action.option_strings, text)
    help_text = " ".join(bench_parser().format_help().split())
    assert (
        "--timeline-steps TIMELINE_STEPS draw only the first N steps in the batch timeline (default: all" in help_text
    )


def test_version(capsys):
    import batchserve

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"batchserve {batchserve.__version__}"
