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
