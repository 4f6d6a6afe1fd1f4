"""vLLM's and llama.cpp's server flags that batchserve does not take, each with what to use instead (or what is not
built yet), and the test of which of our names a mistyped one may be suggested.

One table serves every edge: the command line (`batchserve serve --enable-lora`, answered by cli.py before the
command's heavy imports), config files and `LLM(...)` keywords (`data_parallel_size` in a YAML file is refused the
same way as the flag). A flag asking for what batchserve does anyway (`--data-parallel-size 1`) is accepted and
dropped. Standard library only: this module is on the path of a mistyped flag, which must answer at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

VLLM, LLAMA_CPP = "vLLM", "llama.cpp"
ANY_VALUE = ("*",)  # `neutral`: every value asks for what batchserve does anyway

# what is not built yet, said once
NO_LORA = ("not built: batchserve serves PEFT LoRA adapters (--enable-lora --lora-modules name=path, --max-loras, "
           "--max-lora-rank, --max-cpu-loras; docs/lora.md)")  # fmt: skip
NO_PARALLEL = ("data and context parallelism are not built: a model is split with --tensor-parallel-size "
               "(docs/parallelism.md); for more throughput run several engines with --replicas N (Ray Serve, "
               "docs/scale-out.md)")  # fmt: skip
NO_POOLING = ("pooling is chosen with --runner pooling (and --convert embed|classify); the pooling method and "
              "normalisation come from the model folder (sentence-transformers' modules.json, docs/embeddings.md)")  # fmt: skip
NO_MULTIMODAL = "multimodal inputs are not built yet: prompts are text or token ids"
NO_TLS = "TLS is not built in: put a TLS-terminating proxy (nginx, Caddy, envoy) in front of the server"
NO_CORS = "CORS headers are not built in: put a proxy in front of the server that adds them"
NO_GPU_SPLIT = ("no partial offload or device split: --device cuda runs the whole model on the GPU, --device cpu on "
                "the CPU")  # fmt: skip
CHOSEN_PER_DEVICE = "nothing to set: the attention and GEMM kernels are chosen per device (docs/cpu-kernels.md)"
PER_REQUEST_SAMPLING = ("sampling is set per request (temperature, top_p, top_k, min_p, repetition_penalty, seed "
                        "in the request body); the server has no sampling defaults")  # fmt: skip
NO_GRAPHS = "--enforce-eager turns CUDA graphs off on a GPU; there is no compilation to configure"
MODEL_FROM_CACHE = ("models are read locally: pass a model folder, a .gguf file, or a Hub id already in the local "
                    "Hugging Face cache (HF_HOME); nothing is downloaded")  # fmt: skip
NO_SLEEP_OR_DISAGG = "not built: one process holds the model and its KV cache for its whole life"
STRUCTURED_PER_REQUEST = ("structured output is set per request (response_format with a JSON schema, or "
                          "guided_json / guided_regex / guided_grammar), with one built-in backend "
                          "(docs/structured-outputs.md)")  # fmt: skip


@dataclass(frozen=True)
class ForeignFlag:
    """Flags of another server, as it spells them (long and short), that batchserve answers with `answer`.
    `takes_value`: the flag is followed by a value (consumed with it). `neutral`: values (as text, any case) that
    ask for what batchserve does anyway: the flag is then accepted and dropped; ANY_VALUE for every value."""

    flags: tuple[str, ...]
    origin: str
    answer: str
    takes_value: bool = True
    neutral: tuple[str, ...] = ()

    def accepts(self, value: object) -> bool:
        text = "true" if value is True else "false" if value is False else str(value).lower()
        return self.neutral == ANY_VALUE or text in self.neutral

    def refusal(self, spelled: str) -> str:
        return f"{spelled} is {self.origin}'s: {self.answer}"


def _f(flags: str, origin: str, answer: str, takes_value: bool = True, neutral: tuple[str, ...] = ()) -> ForeignFlag:
    return ForeignFlag(tuple(flags.split()), origin, answer, takes_value, neutral)


BOTH = f"{VLLM} and {LLAMA_CPP}"
FOREIGN_FLAGS: tuple[ForeignFlag, ...] = (
    # --- LoRA and adapters ---------------------------------------------------------------------------------------
    _f("--lora-dtype --lora-extra-vocab-size "
       "--long-lora-scaling-factors --default-mm-loras --prompt-adapters --max-prompt-adapters "
       "--max-prompt-adapter-token", VLLM, NO_LORA),
    _f("--fully-sharded-loras --enable-prompt-adapter", VLLM, NO_LORA, takes_value=False),
    _f("--lora --lora-scaled --control-vector --control-vector-scaled --control-vector-layer-range", LLAMA_CPP,
       NO_LORA),
    _f("--lora-init-without-apply", LLAMA_CPP, NO_LORA, takes_value=False),
    # --- parallelism -----------------------------------------------------------------------------------------------
    _f("-tp -pp", VLLM, "use the long flags: --tensor-parallel-size N, --pipeline-parallel-size M",
       neutral=("1",)),
    _f("--data-parallel-size -dp --data-parallel-size-local "
       "--data-parallel-address --data-parallel-rpc-port --data-parallel-backend --data-parallel-start-rank "
       "--decode-context-parallel-size -dcp", VLLM, NO_PARALLEL, neutral=("1",)),
    _f("--max-parallel-loading-workers --worker-cls --worker-extension-cls "
       "--api-server-count", VLLM, NO_PARALLEL),
    _f("--enable-expert-parallel --disable-custom-all-reduce --ray-workers-use-nsight --headless "
       "--data-parallel-hybrid-lb --data-parallel-external-lb --enable-eplb", VLLM, NO_PARALLEL, takes_value=False),
    _f("--split-mode -sm --tensor-split -ts --main-gpu -mg --device-draft -devd --rpc", LLAMA_CPP, NO_PARALLEL),
    # --- pooling: embeddings, rerank, score ------------------------------------------------------------------------
    _f("--task --override-pooler-config --pooler-config", VLLM, NO_POOLING, neutral=("generate", "auto")),
    _f("--embedding --embeddings --reranking --rerank", LLAMA_CPP, NO_POOLING, takes_value=False),
    _f("--pooling", LLAMA_CPP, NO_POOLING),
    # --- llama.cpp's names for what batchserve has -----------------------------------------------------------------
    _f("-c --ctx-size", LLAMA_CPP, "use --max-model-len N for a request's prompt + output, and --num-kv-blocks N "
       "(blocks of --block-size tokens) for the KV pool all requests share"),
    _f("-np --parallel", LLAMA_CPP, "use --max-batch-size N: sequences decoded together (llama.cpp's slots); "
       "continuous batching is always on"),
    _f("-b --batch-size -ub --ubatch-size", LLAMA_CPP, "use --max-num-tokens N: tokens in one forward pass"),
    _f("-m", LLAMA_CPP, "pass the model as the positional argument or --model: a .gguf file, a folder or a Hub id"),
    _f("-hf -hfr --hf-repo -hff --hf-file -mu --model-url", LLAMA_CPP, MODEL_FROM_CACHE),
    _f("-t --threads -tb --threads-batch", LLAMA_CPP, "use --num-threads N"),
    _f("-ngl --gpu-layers --n-gpu-layers -dev -ngld --gpu-layers-draft --n-gpu-layers-draft", LLAMA_CPP,
       NO_GPU_SPLIT),
    _f("-fa --flash-attn", LLAMA_CPP, CHOSEN_PER_DEVICE),
    _f("-ctk --cache-type-k -ctv --cache-type-v -ctkd --cache-type-k-draft -ctvd --cache-type-v-draft", LLAMA_CPP,
       "use --kv-cache-dtype (auto, bfloat16, float32, int8, fp8_e4m3; docs/kv-cache-quantization.md)"),
    _f("-cb --cont-batching", LLAMA_CPP, "continuous batching is always on (--scheduler-policy static for the "
       "baseline)", takes_value=False, neutral=ANY_VALUE),
    _f("-nocb --no-cont-batching", LLAMA_CPP, "use --scheduler-policy static", takes_value=False),
    _f("--cache-reuse", LLAMA_CPP, "use --enable-prefix-caching (on by default): full KV blocks are shared between "
       "requests with a common prefix"),
    _f("--no-cache-prompt --cache-prompt", LLAMA_CPP, "prompt caching is --enable-prefix-caching (on by default)",
       takes_value=False),
    _f("--mlock --no-mmap --mmap --no-kv-offload -nkvo --kv-unified -kvu --swa-full --no-warmup --check-tensors "
       "--no-op-offload --no-repack", LLAMA_CPP, "nothing to set: weights are loaded into memory at start-up and the "
       "KV pool is one allocation", takes_value=False),
    _f("--numa --override-tensor -ot --override-kv -cmoe --cpu-moe -ncmoe --n-cpu-moe", LLAMA_CPP,
       "nothing to set: threads and placement follow --num-threads and --device"),
    _f("-a --alias", LLAMA_CPP, "use --served-model-name NAME (comma-separated aliases)"),
    _f("--api-key-file", LLAMA_CPP, "use --api-key KEY or the BATCHSERVE_API_KEY environment variable"),
    _f("--ssl-key-file --ssl-cert-file", LLAMA_CPP, NO_TLS),
    _f("-to --timeout", LLAMA_CPP, "use --header-timeout and --body-timeout (seconds) for slow clients"),
    _f("--threads-http", LLAMA_CPP, "nothing to set: HTTP is served on one event loop"),
    _f("--path --api-prefix", LLAMA_CPP, "static files and a path prefix are not built in: put a proxy in front"),
    _f("--no-webui --webui", LLAMA_CPP, "there is no web UI to turn off; the live dashboard is at /dashboard",
       takes_value=False, neutral=ANY_VALUE),
    _f("--metrics", LLAMA_CPP, "/metrics is always on (Prometheus text)", takes_value=False, neutral=ANY_VALUE),
    _f("--slots --no-slots", LLAMA_CPP, "llama.cpp's /slots is not built: /dashboard and /metrics show the running "
       "and waiting requests", takes_value=False),
    _f("--props", LLAMA_CPP, "llama.cpp's /props is not built: GET /v1/models names the model and its context "
       "length", takes_value=False),
    _f("--slot-save-path --slot-prompt-similarity -sps", LLAMA_CPP, "slots are not built: requests share KV blocks "
       "through --enable-prefix-caching"),
    _f("-n --n-predict --predict", LLAMA_CPP, "set max_tokens in the request; a request's prompt + output is bounded "
       "by --max-model-len"),
    _f("--keep", LLAMA_CPP, "use --truncation left (keep a long prompt's end) or right (keep its start)"),
    _f("--context-shift --no-context-shift", LLAMA_CPP, "no context shifting: a request ends at --max-model-len; "
       "--truncation left keeps a long prompt's end", takes_value=False),
    _f("--temp --temperature --top-k --top-p --min-p --typical --repeat-penalty --repeat-last-n --presence-penalty "
       "--frequency-penalty --mirostat --mirostat-lr --mirostat-ent --dynatemp-range --dynatemp-exp --xtc-probability "
       "--xtc-threshold --dry-multiplier --dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker "
       "--samplers --sampling-seq --logit-bias -l --top-nsigma", LLAMA_CPP, PER_REQUEST_SAMPLING),
    _f("-s", LLAMA_CPP, "use --seed N"),
    _f("--grammar --grammar-file -j --json-schema -jf --json-schema-file", LLAMA_CPP, STRUCTURED_PER_REQUEST),
    _f("-md --model-draft --draft --draft-max --draft-n --draft-min --draft-n-min --draft-p-min -cd --ctx-size-draft "
       "--spec-replace", LLAMA_CPP, "use --speculative-config '{\"model\": \"DRAFT\", \"num_speculative_tokens\": N}' "
       "(docs/speculative-decoding.md)"),
    _f("--jinja --no-jinja", LLAMA_CPP, "chat templates are always the model's Jinja template; --chat-template FILE "
       "overrides it", takes_value=False, neutral=ANY_VALUE),
    _f("--chat-template-file --chat-template-kwargs", LLAMA_CPP, "use --chat-template FILE"),
    _f("--reasoning-format", LLAMA_CPP, "use --reasoning-parser NAME: the reasoning goes to reasoning_content"),
    _f("--reasoning-budget", LLAMA_CPP, "a reasoning budget is not built: bound the reply with max_tokens"),
    _f("--rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor "
       "--yarn-attn-factor --yarn-beta-slow --yarn-beta-fast", LLAMA_CPP, "RoPE scaling is read from the model's "
       "own config; it cannot be overridden"),
    _f("-v --verbose --log-verbose -lv --verbosity --log-verbosity --log-file --log-colors --log-prefix "
       "--log-timestamps", LLAMA_CPP, "use --log-level (critical, error, warning, info, debug) and --log-format json"),
    _f("--log-disable", LLAMA_CPP, "use --log-level error", takes_value=False),
    _f("-e --escape --no-escape --special -sp", LLAMA_CPP, "nothing to set: the server takes JSON, and special "
       "tokens follow the request's skip_special_tokens", takes_value=False),
    _f("--mmproj --mmproj-url --no-mmproj --no-mmproj-offload", LLAMA_CPP, NO_MULTIMODAL),
    # --- vLLM's names for what batchserve has, or does not ----------------------------------------------------------
    _f("--trust-remote-code", VLLM, "not needed: the architectures batchserve runs are built in (docs/models.md)",
       takes_value=False, neutral=ANY_VALUE),
    _f("--download-dir --revision --code-revision --tokenizer-revision --hf-token --hf-config-path", VLLM,
       MODEL_FROM_CACHE),
    _f("--load-format --tokenizer-mode --config-format --model-impl --model-loader-extra-config", VLLM,
       "nothing to choose: the format is read from the path (a .gguf file, or a folder of safetensors and its "
       "tokenizer)", neutral=("auto",)),
    _f("--skip-tokenizer-init", VLLM, "not built: the server tokenizes (send token ids as the prompt to skip it)",
       takes_value=False),
    _f("--hf-overrides --rope-scaling --rope-theta --override-neuron-config --override-generation-config "
       "--generation-config", VLLM, "not built: the model's own config.json is used as it is"),
    _f("--max-seq-len-to-capture --cuda-graph-sizes --compilation-config -O --kv-sharing-fast-prefill", VLLM,
       NO_GRAPHS),
    _f("--scheduling-policy", VLLM, "use --scheduling-order (fcfs, priority, shortest_first)"),
    _f("--scheduler-delay-factor --num-scheduler-steps --scheduler-cls --async-scheduling", VLLM,
       "not built: the scheduler is set with --scheduler-policy, --scheduling-order and --max-num-tokens"),
    _f("--cpu-offload-gb --kv-transfer-config --kv-events-config --enable-sleep-mode --kv-offloading-size", VLLM,
       NO_SLEEP_OR_DISAGG),
    _f("--calculate-kv-scales", VLLM, "not needed: --kv-cache-dtype int8 / fp8_e4m3 computes per-token scales as it "
       "writes", takes_value=False),
    _f("--prefix-caching-hash-algo", VLLM, "nothing to choose: --enable-prefix-caching hashes blocks one way"),
    _f("--limit-mm-per-prompt --mm-processor-kwargs --disable-mm-preprocessor-cache --mm-processor-cache-gb "
       "--media-io-kwargs --allowed-local-media-path --interleave-mm-strings --mm-encoder-tp-mode", VLLM,
       NO_MULTIMODAL),
    _f("--guided-decoding-backend --guided-decoding-disable-fallback --structured-outputs-config "
       "--logits-processor-pattern --logits-processors", VLLM, STRUCTURED_PER_REQUEST),
    _f("--disable-sliding-window --disable-cascade-attn --disable-chunked-mm-input", VLLM,
       "not built: sliding windows and attention are run as the model defines them (docs/sliding-window.md)",
       takes_value=False),
    _f("--max-logprobs --max-log-len", VLLM, "not built: logprobs are bounded per request (top_logprobs at most 20)"),
    _f("--speculative-model --num-speculative-tokens --speculative-draft-tensor-parallel-size "
       "--ngram-prompt-lookup-max --ngram-prompt-lookup-min", VLLM,
       "use --speculative-config with vLLM's JSON shape (docs/speculative-decoding.md)"),
    _f("--ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --enable-ssl-refresh", VLLM, NO_TLS),
    _f("--allowed-origins --allowed-methods --allowed-headers", VLLM, NO_CORS),
    _f("--allow-credentials", VLLM, NO_CORS, takes_value=False),
    _f("--root-path --middleware --uds", VLLM, "not built: put a proxy in front of the server for a path prefix, "
       "middleware or a Unix socket"),
    _f("--uvicorn-log-level", VLLM, "use --log-level"),
    _f("--disable-uvicorn-access-log --disable-log-requests --enable-log-requests --disable-log-stats "
       "--enable-log-outputs --disable-fastapi-docs --enable-request-id-headers", VLLM, "nothing to set: requests "
       "are logged one line each at --log-level info (--log-format json for a machine-readable access log), "
       "request ids come back as X-Request-Id", takes_value=False, neutral=ANY_VALUE),
    _f("--collect-detailed-traces --show-hidden-metrics-for-version", VLLM, "traces go to --otlp-traces-endpoint; "
       "/metrics shows every metric"),
    _f("--response-role --chat-template-content-format --tool-parser-plugin --tool-server", VLLM,
       "not built: assistant replies take the role assistant, content is text, tool-call parsers are "
       "--tool-call-parser's built-in ones"),
    _f("--enable-auto-tool-choice", VLLM, "not needed: tool_choice auto works whenever --tool-call-parser is set",
       takes_value=False, neutral=ANY_VALUE),
    _f("--return-tokens-as-token-ids --enable-prompt-tokens-details --enable-server-load-tracking "
       "--enable-force-include-usage --enable-tokenizer-info-endpoint "
       "--exclude-tools-when-tool-choice-none --log-error-stack --h11-max-incomplete-event-size "
       "--h11-max-header-count", VLLM, "not built: the server's answers follow the OpenAI API as it is",
       takes_value=False),
    _f("--additional-config --reasoning-parser-plugin --served-model-names", VLLM,
       "not built: --reasoning-parser and --served-model-name take the built-in choices"),
    _f("--enable-responses-api-store", VLLM, "always on: stored responses are kept in a bounded in-memory store",
       takes_value=False, neutral=ANY_VALUE),
    _f("--quantization-param-path --kv-quant-params-path", VLLM, "not needed: --kv-cache-dtype int8 / fp8_e4m3 "
       "computes its scales at run time"),
    _f("-q", VLLM, "use --quantization (auto, none, gguf, int8, int4, int4_g64, int4_g128; docs/quantization.md)"),
    _f("--log-config-file", VLLM, "use --log-level and --log-format json"),
    _f("--logprobs-mode --override-attention-dtype --io-processor-plugin --mamba-cache-dtype --mamba-ssm-cache-dtype "
       "--ignore-patterns --pt-load-map-location --eplb-config --num-redundant-experts --num-lookahead-slots", VLLM,
       "not built: batchserve has no such setting (docs/configuration.md lists every option)"),
    _f("--enable-prompt-embeds --disable-async-output-proc --use-tqdm-on-load --guided-decoding-disable-any-whitespace "
       "--guided-decoding-disable-additional-properties --skip-mm-profiling --enable-lora-bias "
       "--multi-step-stream-outputs --disable-hybrid-kv-cache-manager --enable-multimodal-encoder-data-parallel",
       VLLM, "not built: batchserve has no such setting (docs/configuration.md lists every option)",
       takes_value=False),
    _f("-dpn --data-parallel-rank", VLLM, NO_PARALLEL, neutral=("0",)),
    # --- llama.cpp's remaining server flags ---------------------------------------------------------------------------
    _f("--version", LLAMA_CPP, "the version is a top-level flag: `batchserve -V`", takes_value=False),
    _f("--usage --completion-bash --list-devices --verbose-prompt", LLAMA_CPP, "not built: `batchserve serve --help` "
       "lists every option; the start-up log names the device and the CPU path", takes_value=False),
    _f("--offline", LLAMA_CPP, "always so: nothing is downloaded", takes_value=False, neutral=ANY_VALUE),
    _f("--no-perf", LLAMA_CPP, "nothing to set: timings go to /metrics", takes_value=False, neutral=ANY_VALUE),
    _f("-C --cpu-mask -Cr --cpu-range --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch --prio-batch "
       "--poll-batch", LLAMA_CPP, "not built: threads follow --num-threads; pin the process with taskset"),
    _f("--cpu-strict --cpu-strict-batch", LLAMA_CPP, "not built: threads follow --num-threads; pin the process with "
       "taskset"),
    _f("-nr", LLAMA_CPP, "nothing to set: weights are loaded into memory at start-up and the KV pool is one "
       "allocation", takes_value=False),
    _f("-dt --defrag-thold", LLAMA_CPP, "nothing to set: the paged KV pool does not fragment"),
    _f("-hfd -hfrd --hf-repo-draft -hfv -hfrv --hf-repo-v -hffv --hf-file-v -hft", LLAMA_CPP, MODEL_FROM_CACHE),
    _f("--ignore-eos", LLAMA_CPP, "set ignore_eos per request (in the request body)", takes_value=False),
    _f("-r --reverse-prompt", LLAMA_CPP, "set stop per request (in the request body)"),
    _f("--spm-infill --no-prefill-assistant", LLAMA_CPP, "not built: /v1/completions continues the prompt, "
       "/v1/chat/completions answers the conversation", takes_value=False),
    _f("--swa-checkpoints --ctx-checkpoints -cram --cache-ram", LLAMA_CPP, "nothing to set: the prefix cache keeps "
       "full KV blocks of the pool (--enable-prefix-caching)"),
    _f("-td --threads-draft -tbd --threads-batch-draft", LLAMA_CPP, "use --num-threads N (the draft model shares "
       "the engine's threads)"),
    _f("-mv --model-vocoder", LLAMA_CPP, "text to speech is not built"),
    _f("--tts-use-guide-tokens", LLAMA_CPP, "text to speech is not built", takes_value=False),
    _f("--sampler-seq", LLAMA_CPP, PER_REQUEST_SAMPLING),
)  # fmt: skip

FOREIGN_BY_FLAG: dict[str, ForeignFlag] = {flag: entry for entry in FOREIGN_FLAGS for flag in entry.flags}
# config-file / LLM(...) keys: the long flags with underscores (data_parallel_size)
FOREIGN_BY_KEY: dict[str, ForeignFlag] = {
    flag.removeprefix("--").replace("-", "_"): entry
    for entry in FOREIGN_FLAGS
    for flag in entry.flags
    if flag.startswith("--")
}


def foreign_option(key: str) -> ForeignFlag | None:
    """The table's entry for a config-file key or keyword (data_parallel_size, or spelled with dashes)."""
    return FOREIGN_BY_KEY.get(key.replace("-", "_"))


# --- which of our names a mistyped one may be suggested ----------------------------------------------------------

# words that qualify a name without saying what it is about: a suggestion may add them ("--prefix-caching" ->
# "--enable-prefix-caching"), never only share them ("--enable-lora" is not "--enable-prefix-caching")
QUALIFIERS = frozenset({"enable", "disable", "no", "max", "min", "num", "use"})


def _words(name: str) -> list[str]:
    return [word for word in re.split(r"[-_]+", name.lstrip("-").lower()) if word]


def _same_word(typed: str, known: str) -> bool:
    """One word, mistyped or inflected: sise / size, cache / caching, seq / seqs."""
    if typed == known or typed.rstrip("s") == known.rstrip("s"):
        return True
    if min(len(typed), len(known)) < 4:
        return False
    common = len(next((p for p in _prefixes(typed, known)), ""))
    return common >= 4 or SequenceMatcher(None, typed, known).ratio() >= 0.75


def _prefixes(a: str, b: str) -> Iterable[str]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    yield a[:n]


def shares_meaning(typed: str, known: str) -> bool:
    """Every word of `typed` is a word of `known` (mistyped or inflected at most), and what `known` adds are
    qualifiers only."""
    left = _words(known)
    for word in _words(typed):
        match = next((k for k in left if _same_word(word, k)), None)
        if match is None:
            return False
        left.remove(match)
    return all(word in QUALIFIERS for word in left)


def similar_name(typed: str, known: Iterable[str]) -> str | None:
    """The known name that means what `typed` seems to mean, the closest spelling first; None when none does."""
    candidates = [name for name in known if name != typed and shares_meaning(typed, name)]
    return max(candidates, key=lambda name: SequenceMatcher(None, typed, name).ratio(), default=None)


# --- the command line ----------------------------------------------------------------------------------------------

NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass
class FlagScreen:
    """The command line with the neutral foreign flags dropped, and one line per flag refused."""

    argv: list[str]
    problems: list[str]


def screen_flags(argv: Sequence[str], known: Iterable[str], report_unknown: bool = True) -> FlagScreen:
    """Foreign flags answered by the table (or dropped where neutral); a command's own flags (`known`) always win.
    With `report_unknown`, every other flag argparse would not take is reported too, with a suggestion that shares
    its meaning. Mirrors argparse's reading of a token (abbreviations of known flags, negative numbers, everything
    after `--`), except that a foreign flag is never read as an abbreviation of ours (llama.cpp's --keep is not
    --keep-alive-timeout)."""
    known = set(known)
    kept: list[str] = []
    problems: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token == "--":
            kept.extend(tokens[i - 1 :])
            break
        name, has_inline, inline = token.partition("=")
        entry = FOREIGN_BY_FLAG.get(name)
        if not _looks_like_flag(token) or name in known or (entry is None and _argparse_knows(token, known)):
            kept.append(token)
            continue
        if entry is None:
            if report_unknown:
                close = similar_name(name, (k for k in known if k.startswith("--")))
                problems.append(name + (f": did you mean {close}?" if close else ""))
            else:
                kept.append(token)
            continue
        value: object = True
        if entry.takes_value and not has_inline and i < len(tokens) and not _looks_like_flag(tokens[i]):
            value, i = tokens[i], i + 1
        elif has_inline:
            value = inline
        if not entry.accepts(value):
            problems.append(entry.refusal(name))
    return FlagScreen(kept, problems)


def _looks_like_flag(token: str) -> bool:
    return token.startswith("-") and token != "-" and not NEGATIVE_NUMBER.match(token) and " " not in token


def _argparse_knows(token: str, known: set[str]) -> bool:
    """argparse takes the token as one of `known`: exactly, with =value, as a unique-or-not abbreviation (argparse
    reports an ambiguous one itself), or a short flag with its value attached (-n4)."""
    name = token.split("=", 1)[0]
    if name in known or any(flag.startswith(name) for flag in known if len(name) > 2 or not flag.startswith("--")):
        return True
    return not token.startswith("--") and token[:2] in known


def flag_error(prog: str, problems: Sequence[str]) -> str:
    """The one message every path gives for refused flags (cli.py's early check and the parsers alike)."""
    lines = "\n".join(f"  {problem}" for problem in problems)
    return f"{prog}: error: unrecognized arguments:\n{lines}\n(`{prog} --help` lists every option)\n"
