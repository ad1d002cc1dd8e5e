"""``prefixcache generate``: run prompts through the engine and print the text.

The text is streamed to stdout as it is generated; a one-line summary per prompt (tokens,
cached tokens, time to first token) goes to stderr so that stdout stays just the text.
Several prompts run one after another on one engine, so later prompts show the prefix
cache at work. Bad options or a model that cannot be loaded give a one-line error and
exit code 2; every option and prompt that can be checked without the model is checked
before it loads. Errors about a prompt name it by its position on the command line
(``prompt 2: ...``), never by the engine's internal request id.
"""

from __future__ import annotations

import argparse
import copy
import sys

from prefixcache.arg_types import int_in_range, non_negative_float, utf8_text
from prefixcache.engine.arg_utils import MAX_SEED, MIN_SEED, EngineArgs
from prefixcache.lora.modules import lora_module

EXIT_USAGE = 2
REQUEST_ID_PREFIX = "generate-"

_DESCRIPTION = """\
Generate text for one or more prompts and stream it to stdout.

After each prompt a summary line (prompt tokens, cached tokens, generated tokens, time to
first token) is printed to stderr. Prompts run one after another on the same engine, so a
prompt that shares a prefix with an earlier one (the chat template, a --system message)
reuses its cached KV blocks: watch "cached" and "ttft". The default model is
SmolLM2-135M-Instruct.

examples:
  prefixcache generate "The capital of France is"
  prefixcache generate --chat --system "You are a geography tutor. Answer in one sentence." \
      "What is the capital of France?" "What is the capital of Japan?"
  prefixcache generate --chat "Write a haiku about caches." --temperature 0.7 --seed 1
  prefixcache generate --model ./my-llama-folder --max-tokens 64 "Once upon a time"
  prefixcache generate --no-enable-prefix-caching "Hello" "Hello again"
  prefixcache generate --model ./my-llama-folder --lora poet=./poet-adapter "Roses are"
"""

# Prompts run one after another: a KV pool for one full-context sequence is enough.
ENGINE_DEFAULTS = {"max_num_seqs": 1}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", type=utf8_text,
                        help="prompt text (with --chat: a user message); several run in turn")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the model's chat template")
    parser.add_argument("--system", default=None, type=utf8_text,
                        help="with --chat (required): a system message to put first")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N",
                        help="generate at most N tokens (default: 128)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0,
                        help="0 for greedy decoding (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1)")
    parser.add_argument("--top-k", type=int, default=0, help="0 keeps all tokens (default: 0)")
    # Each prompt's own seed (dest sampling_seed): the engine's --seed is left out.
    parser.add_argument("--seed", dest="sampling_seed", default=None,
                        type=int_in_range(MIN_SEED, MAX_SEED),
                        help="seed for reproducible sampling (a signed 64-bit integer)")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        type=utf8_text,
                        help="stop when TEXT is generated (repeatable); not printed")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token")
    parser.add_argument("--no-stream", action="store_true",
                        help="print the text once finished instead of as it is generated")
    parser.add_argument("--lora", type=lora_module, default=None, metavar="NAME=PATH",
                        help="run every prompt with this LoRA adapter (a PEFT folder); "
                             "implies --enable-lora")
    EngineArgs.add_cli_args(parser, exclude=("seed",), defaults=ENGINE_DEFAULTS)
    parser.set_defaults(func=run)


def _error(message: str) -> int:
    print(f"prefixcache generate: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _about_prompt(position: int, num_prompts: int, message: str) -> str:
    """``message`` about the prompt at 1-based ``position``, saying which one when there
    are several. Engine refusals come as ``InvalidRequestError``, whose ``message`` does
    not name the internal request id."""
    return message if num_prompts == 1 else f"prompt {position}: {message}"


def _check_without_model(args: argparse.Namespace, params) -> str | None:
    """What is wrong with the options or prompts, as far as can be told before the model
    loads (which takes seconds), or None."""
    if args.system is not None and not args.chat:
        # Not implied: without --chat the prompt is raw text, and silently switching the
        # mode would change what the model sees.
        return "--system needs --chat (a system message is part of a chat template)"
    if not args.chat:
        for position, prompt in enumerate(args.prompts, start=1):
            if not prompt:
                return "the prompt is empty" if len(args.prompts) == 1 \
                    else f"prompt {position} is empty"
    try:
        params.validate()
    except ValueError as error:
        return str(error)
    return None


def run(args: argparse.Namespace) -> int:
    from prefixcache.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    problem = _check_without_model(args, params)
    if problem is not None:
        return _error(problem)
    # Heavy imports here, so `prefixcache --help` and option errors do not load torch.
    from prefixcache.engine.llm_engine import LLMEngine

    if args.lora is not None:
        args.enable_lora = True
    try:
        engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
        if args.lora is not None:
            engine.add_lora(args.lora)  # a bad adapter is said once, before any prompt
    except (ValueError, FileNotFoundError, OSError) as error:
        return _error(str(error))
    num_prompts = len(args.prompts)
    prompts_token_ids = []
    for position, prompt in enumerate(args.prompts, start=1):
        try:
            prompts_token_ids.append(_encode(engine, args, prompt))
        except ValueError as error:
            return _error(_about_prompt(position, num_prompts, str(error)))
    for position, prompt_token_ids in enumerate(prompts_token_ids, start=1):
        exit_code = _generate_one(engine, args, params, position, num_prompts,
                                  prompt_token_ids)
        if exit_code:
            return exit_code
    return 0


def _encode(engine, args: argparse.Namespace, prompt: str) -> list[int]:
    """The prompt's token ids (through the chat template with --chat). ValueError when
    it leaves no room in the model's context for even one generated token."""
    tokenizer = engine.tokenizer
    if args.chat:
        messages = [] if args.system is None else [{"role": "system", "content": args.system}]
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_token_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_token_ids = tokenizer.encode(prompt)
    if len(prompt_token_ids) >= engine.max_model_len:
        raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) fills the model's "
                         f"context of {engine.max_model_len} tokens")
    return prompt_token_ids


def _generate_one(engine, args: argparse.Namespace, params, position: int, num_prompts: int,
                  prompt_token_ids: list[int]) -> int:
    """Run the prompt at ``position`` to completion, printing its text and summary; the
    exit code."""
    params = copy.copy(params)
    params.max_tokens = min(params.max_tokens, engine.max_model_len - len(prompt_token_ids))
    from prefixcache.engine.errors import InvalidRequestError

    try:
        engine.add_request(f"{REQUEST_ID_PREFIX}{position}", prompt_token_ids, params,
                           lora_request=args.lora)
    except InvalidRequestError as error:
        return _error(_about_prompt(position, num_prompts, error.message))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not args.no_stream and output.new_text:
                sys.stdout.write(output.new_text)
                sys.stdout.flush()
            if output.finished:
                final = output
    if args.no_stream:
        sys.stdout.write(final.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    ttft = final.metrics.time_to_first_token
    print(
        f"[{len(final.prompt_token_ids)} prompt tokens, {final.num_cached_tokens} cached, "
        f"{len(final.token_ids)} generated, finish_reason={final.finish_reason}, "
        f"ttft={'n/a' if ttft is None else f'{ttft:.3f}s'}]",
        file=sys.stderr,
    )
    if final.finish_reason == "error":
        message = _about_prompt(position, num_prompts, str(final.error))
        print(f"prefixcache generate: error: {message}", file=sys.stderr)
        return 1
    return 0
