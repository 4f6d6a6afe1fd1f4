"""vLLM's and llama.cpp's server flags: every one batchserve lacks is answered by name with what to use instead, the
same on the command line and in a config file; suggestions only among names of the same meaning; a mistyped flag
answers before any heavy import."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchserve.cli import main
from batchserve.config import ConfigError
from batchserve.entrypoints.cli_flags import COMMAND_FLAGS, PARSERS, flags_of_parsers
from batchserve.entrypoints.engine_options import engine_config
from batchserve.entrypoints.foreign_flags import FOREIGN_BY_FLAG, FOREIGN_FLAGS, screen_flags, similar_name

REPO = Path(__file__).resolve().parent.parent

# The flags of `vllm serve` (its front end and engine arguments) and of llama.cpp's `llama-server`, as their --help
# lists them; the presets and example-only flags of llama.cpp's common argument table are left out.
VLLM_SERVE_FLAGS = """
--host --port --uds --uvicorn-log-level --disable-uvicorn-access-log --allow-credentials --allowed-origins
--allowed-methods --allowed-headers --api-key --lora-modules --prompt-adapters --chat-template
--chat-template-content-format --response-role --ssl-keyfile --ssl-certfile --ssl-ca-certs --enable-ssl-refresh
--ssl-cert-reqs --root-path --middleware --return-tokens-as-token-ids --disable-frontend-multiprocessing
--enable-request-id-headers --enable-auto-tool-choice --exclude-tools-when-tool-choice-none --tool-call-parser
--tool-parser-plugin --tool-server --log-config-file --max-log-len --disable-fastapi-docs
--enable-prompt-tokens-details --enable-server-load-tracking --enable-force-include-usage
--enable-tokenizer-info-endpoint --log-error-stack --h11-max-incomplete-event-size --h11-max-header-count --headless
--api-server-count --config --disable-log-requests --enable-log-requests --enable-log-outputs
--model --task --runner --convert --tokenizer --tokenizer-mode --trust-remote-code --dtype --seed --hf-config-path
--allowed-local-media-path --revision --code-revision --rope-scaling --rope-theta --tokenizer-revision
--max-model-len --quantization -q --enforce-eager --max-seq-len-to-capture --max-logprobs --logprobs-mode
--disable-sliding-window --disable-cascade-attn --skip-tokenizer-init --enable-prompt-embeds --served-model-name
--disable-async-output-proc --config-format --hf-token --hf-overrides --override-neuron-config
--override-pooler-config --pooler-config --logits-processor-pattern --generation-config --override-generation-config
--enable-sleep-mode --model-impl --override-attention-dtype --logits-processors --io-processor-plugin
--load-format --download-dir --model-loader-extra-config --ignore-patterns --use-tqdm-on-load --pt-load-map-location
--guided-decoding-backend --guided-decoding-disable-fallback --guided-decoding-disable-any-whitespace
--guided-decoding-disable-additional-properties --reasoning-parser --structured-outputs-config
--distributed-executor-backend --pipeline-parallel-size -pp --tensor-parallel-size -tp
--decode-context-parallel-size -dcp --data-parallel-size -dp --data-parallel-rank -dpn --data-parallel-start-rank
--data-parallel-size-local --data-parallel-address --data-parallel-rpc-port --data-parallel-backend
--data-parallel-hybrid-lb --data-parallel-external-lb --enable-expert-parallel --enable-eplb --eplb-config
--num-redundant-experts --max-parallel-loading-workers --ray-workers-use-nsight --disable-custom-all-reduce
--worker-cls --worker-extension-cls --enable-multimodal-encoder-data-parallel
--block-size --gpu-memory-utilization --swap-space --kv-cache-dtype --num-gpu-blocks-override
--enable-prefix-caching --prefix-caching-hash-algo --cpu-offload-gb --calculate-kv-scales --kv-sharing-fast-prefill
--mamba-cache-dtype --mamba-ssm-cache-dtype
--limit-mm-per-prompt --media-io-kwargs --mm-processor-kwargs --mm-processor-cache-gb
--disable-mm-preprocessor-cache --mm-encoder-tp-mode --interleave-mm-strings --skip-mm-profiling
--enable-lora --enable-lora-bias --max-loras --max-lora-rank --lora-extra-vocab-size --lora-dtype --max-cpu-loras
--fully-sharded-loras --default-mm-loras
--max-num-batched-tokens --max-num-seqs --max-num-partial-prefills --max-long-partial-prefills --cuda-graph-sizes
--long-prefill-token-threshold --num-lookahead-slots --scheduler-delay-factor --preemption-mode
--num-scheduler-steps --multi-step-stream-outputs --scheduling-policy --enable-chunked-prefill
--disable-chunked-mm-input --scheduler-cls --disable-hybrid-kv-cache-manager --async-scheduling
--speculative-config --show-hidden-metrics-for-version --otlp-traces-endpoint --collect-detailed-traces
--kv-transfer-config --kv-events-config --compilation-config -O --additional-config --disable-log-stats --device
""".split()

LLAMA_SERVER_FLAGS = """
-h --help --usage --version --completion-bash --verbose-prompt -t --threads -tb --threads-batch -C --cpu-mask
-Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch --cpu-strict-batch
--prio-batch --poll-batch -c --ctx-size -n --predict --n-predict -b --batch-size -ub --ubatch-size --keep --swa-full
--kv-unified -kvu -fa --flash-attn --no-perf -e --escape --no-escape --rope-scaling --rope-scale --rope-freq-base
--rope-freq-scale --yarn-orig-ctx --yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast
-nkvo --no-kv-offload -nr --no-repack -ctk --cache-type-k -ctv --cache-type-v -dt --defrag-thold -np --parallel
--mlock --no-mmap --numa -dev --device --list-devices -ot --override-tensor -cmoe --cpu-moe -ncmoe --n-cpu-moe
-ngl --gpu-layers --n-gpu-layers -sm --split-mode -ts --tensor-split -mg --main-gpu --check-tensors --override-kv
--no-op-offload --lora --lora-scaled --control-vector --control-vector-scaled --control-vector-layer-range
-m --model -mu --model-url -hf -hfr --hf-repo -hfd -hfrd --hf-repo-draft -hff --hf-file -hfv -hfrv --hf-repo-v
-hffv --hf-file-v -hft --hf-token --log-disable --log-file --log-colors -v --verbose --log-verbose --offline
-lv --verbosity --log-verbosity --log-prefix --log-timestamps -ctkd --cache-type-k-draft -ctvd --cache-type-v-draft
--samplers -s --seed --sampling-seq --sampler-seq --ignore-eos --temp --top-k --top-p --min-p --top-nsigma
--xtc-probability --xtc-threshold --typical --repeat-last-n --repeat-penalty --presence-penalty --frequency-penalty
--dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker --dynatemp-range
--dynatemp-exp --mirostat --mirostat-lr --mirostat-ent -l --logit-bias --grammar --grammar-file -j --json-schema
-jf --json-schema-file --swa-checkpoints --ctx-checkpoints -cram --cache-ram --no-context-shift --context-shift
-r --reverse-prompt -sp --special --no-warmup --spm-infill --pooling -cb --cont-batching -nocb --no-cont-batching
--mmproj --mmproj-url --no-mmproj --no-mmproj-offload -a --alias --host --port --path --api-prefix --no-webui
--embedding --embeddings --reranking --rerank --api-key --api-key-file --ssl-key-file --ssl-cert-file
--chat-template-kwargs -to --timeout --threads-http --cache-reuse --metrics --props --slots --no-slots
--slot-save-path --jinja --reasoning-format --reasoning-budget --chat-template --chat-template-file
--no-prefill-assistant -sps --slot-prompt-similarity --lora-init-without-apply -td --threads-draft
-tbd --threads-batch-draft --draft-max --draft --draft-n --draft-min --draft-n-min --draft-p-min -cd
--ctx-size-draft -devd --device-draft -ngld --gpu-layers-draft --n-gpu-layers-draft -md --model-draft --spec-replace
-mv --model-vocoder --tts-use-guide-tokens
""".split()

SERVE_FLAGS = COMMAND_FLAGS["serve"]


@pytest.mark.parametrize("flag", sorted(set(VLLM_SERVE_FLAGS + LLAMA_SERVER_FLAGS)))
def test_every_flag_of_vllm_and_llama_server_is_taken_or_answered(flag):
    assert flag in SERVE_FLAGS or flag in FOREIGN_BY_FLAG, f"{flag}: neither a flag of serve nor in foreign_flags.py"


def test_a_commands_own_flag_wins_over_the_table():
    assert not SERVE_FLAGS & set(FOREIGN_BY_FLAG)
    for command, flags in COMMAND_FLAGS.items():  # bench's --timeout, generate's --temperature are theirs
        for flag in flags & set(FOREIGN_BY_FLAG):
            assert screen_flags([flag, "1"], flags).argv == [flag, "1"], (command, flag)


@pytest.mark.parametrize("entry", FOREIGN_FLAGS, ids=lambda e: e.flags[0])
def test_every_answer_names_only_flags_that_serve_takes(entry):
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", entry.answer))
    assert named <= SERVE_FLAGS, f"{entry.flags[0]}'s answer names {named - SERVE_FLAGS}"
    assert entry.origin in ("vLLM", "llama.cpp") and entry.answer


def test_the_flag_inventory_matches_the_parsers():
    """cli.py answers a flag from COMMAND_FLAGS before importing the command: it must be what the parsers take
    (after adding a flag: python -m batchserve.entrypoints.cli_flags)."""
    for command in PARSERS:
        assert COMMAND_FLAGS[command] == flags_of_parsers(command), command


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("--enable-lora-bias", None),  # not --enable-prefix-caching: they share only "enable"
        ("--ctx-size", None),  # not --block-size
        ("--max-lora-count", None),  # not --max-replicas
        ("--max-batch-sise", "--max-batch-size"),
        ("--enable-prefix-cache", "--enable-prefix-caching"),
        ("--prefix-caching", "--enable-prefix-caching"),
        ("--max-num-seq", "--max-num-seqs"),
        ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
        ("--replica", "--replicas"),
    ],
)
def test_suggestions_only_among_names_that_share_meaning(typed, expected):
    assert similar_name(typed, [flag for flag in SERVE_FLAGS if flag.startswith("--")]) == expected


@pytest.mark.parametrize(
    ("argv", "answer"),
    [
        (["-c", "4096"], "-c is llama.cpp's: use --max-model-len"),
        (["--ctx-size=4096"], "--ctx-size is llama.cpp's: use --max-model-len"),
        (["--parallel", "4"], "--parallel is llama.cpp's: use --max-batch-size"),
        (["-np", "4"], "-np is llama.cpp's: use --max-batch-size"),
        (["--lora-dtype", "auto"], "--lora-dtype is vLLM's: not built: batchserve serves PEFT LoRA adapters"),
        (["--task", "embed"], "--task is vLLM's: pooling is chosen with --runner pooling"),
        (["--data-parallel-size", "2"], "--data-parallel-size is vLLM's: data and context parallelism are not"),
        (["-tp", "2"], "-tp is vLLM's: use the long flags: --tensor-parallel-size N"),
        (["--keep", "64"], "--keep is llama.cpp's: use --truncation"),  # not --keep-alive-timeout's abbreviation
    ],
)
def test_foreign_flags_are_answered_by_name(argv, answer, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert answer in err and "did you mean" not in err, err


def test_a_flag_that_asks_for_what_we_do_anyway_is_accepted():
    from batchserve.entrypoints.openai.launch import make_parser

    args = make_parser().parse_args(["--tensor-parallel-size", "1", "--trust-remote-code", "--max-num-seqs", "4"])
    assert args.max_batch_size == 4
    assert not screen_flags(["-tp", "1", "--cont-batching"], SERVE_FLAGS).problems


def test_config_file_and_command_line_refuse_alike(tmp_path, capsys):
    path = tmp_path / "engine.yaml"
    path.write_text("data_parallel_size: 2\nmax_batch_size: 8\n")
    with pytest.raises(ConfigError) as err:
        engine_config({}, file=path)
    file_answer = str(err.value)
    assert main(["serve", "--data-parallel-size", "2"]) == 2
    flag_answer = capsys.readouterr().err
    answer = FOREIGN_BY_FLAG["--data-parallel-size"].answer
    assert answer in file_answer and answer in flag_answer
    with pytest.raises(ConfigError, match="lora_dtype' is vLLM's: not built"):
        engine_config({"lora_dtype": "auto"})
    assert engine_config({"enable_lora": True, "max_loras": 2}).max_loras == 2
    path.write_text("data_parallel_size: 1\nmax_batch_size: 8\n")  # what we do anyway: accepted in both
    assert engine_config({}, file=path).scheduler.max_batch_size == 8


def test_a_mistyped_flag_answers_without_importing_anything_heavy():
    probe = (
        "import sys, time; t = time.perf_counter(); from batchserve.cli import main; "
        "rc = main(['serve', '--enable-lorra', '--max-batch-sise', '2']); "
        "print(rc, round(time.perf_counter() - t, 3), *[m for m in ('torch', 'fastapi', 'transformers', 'pydantic', "
        "'batchserve.entrypoints.openai.launch') if m in sys.modules])"
    )
    best = None
    for _ in range(3):  # the host is shared: the best of three runs
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
        wall = time.perf_counter() - start
        best = wall if best is None else min(best, wall)
        rc, _, *heavy = result.stdout.split()
        assert rc == "2" and not heavy, result.stdout
        assert "--max-batch-sise: did you mean --max-batch-size?" in result.stderr, result.stderr
    assert best < 1.0, f"a mistyped flag took {best:.2f} s (whole interpreter)"
