"""Text <-> token ids and chat prompts, over a `tokenizers.Tokenizer`.

`Tokenizer.from_hf_dir` reads a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`
with special tokens and the chat template, or a `chat_template.jinja` file);
`Tokenizer.from_gguf_metadata` rebuilds the tokenizer stored in a GGUF file;
`load_tokenizer(path)` picks by path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from prefixcache.model.chat_template import render_chat_template
from prefixcache.model.gguf_file import open_gguf, read_gguf_metadata
from prefixcache.model.gguf_tokenizer import build_gguf_tokenizer
from prefixcache.model.json_file import read_json_object


class Tokenizer:
    """Encode, decode and render chat prompts for one model.

    `eos_token_ids` is every id that ends generation: the tokenizer's EOS plus any extra
    ones the model config names (Llama 3 Instruct ends turns with `<|eot_id|>`).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = self._known_id(bos_token)
        self.eos_token_id = self._known_id(eos_token)
        eos_ids = [] if self.eos_token_id is None else [self.eos_token_id]
        eos_ids += [i for i in extra_eos_token_ids if i not in eos_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)

    def _known_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS).
        Special-token text such as `<|im_start|>` always maps to its single id.

        Releases the GIL while it tokenizes, so a long text encoded in a worker thread
        does not stop the caller's other threads (the server's event loop)."""
        # `encode_batch` releases the GIL where `encode` holds it; the ids are the same.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template (or `chat_template`).

        With `tokenize=True` returns ids, encoded without adding special tokens - the
        template already wrote any BOS it wants, as in transformers.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=")
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (required) and `tokenizer_config.json` (optional)."""
        model_dir = Path(model_dir)
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in model folder {model_dir}")
        backend = BackendTokenizer.from_file(str(tokenizer_path))
        config = _read_json(model_dir / "tokenizer_config.json")
        chat_template = _hf_chat_template(config.get("chat_template"))
        template_file = model_dir / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        model_config = _read_json(model_dir / "config.json")
        eos = model_config.get("eos_token_id")
        extra_eos = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            chat_template=chat_template,
            extra_eos_token_ids=extra_eos,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Rebuild from GGUF metadata (see `read_gguf_metadata`)."""
        backend = build_gguf_tokenizer(metadata)
        tokens = metadata["tokenizer.ggml.tokens"]
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        eot_id = metadata.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token=None if bos_id is None else tokens[bos_id],
            eos_token=None if eos_id is None else tokens[eos_id],
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_eos_token_ids=() if eot_id is None else (eot_id,),
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder or a `.gguf` file."""
    path = Path(path)
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(path)))
    return Tokenizer.from_hf_dir(path)


def _read_json(path: Path) -> dict[str, Any]:
    # Optional files: absent is empty; present must be a JSON object.
    if not path.is_file():
        return {}
    return read_json_object(path)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _hf_chat_template(value: Any) -> str | None:
    # Either one template, or a list of {"name", "template"} of which "default" is used.
    if value is None or isinstance(value, str):
        return value
    named = {entry["name"]: entry["template"] for entry in value}
    return named.get("default") or next(iter(named.values()), None)
