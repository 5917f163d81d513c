"""Build the tiny random Llama the e2e engines serve: locally, deterministically, no download.

``python tests/e2e/model.py OUT_DIR`` (run with ``.venv-e2e``'s interpreter: it needs
transformers, torch and tokenizers) writes a Hugging Face model directory:

- ``tokenizer.json``: a byte-level BPE (HF ``tokenizers``) trained on a corpus generated here from
  a fixed word list and a seeded RNG (the same words the e2e workload writes its prompts with), with
  special tokens ``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|start_header_id|>``,
  ``<|end_header_id|>``, ``<|eot_id|>``; ``add_special_tokens`` prepends ``<|begin_of_text|>``;
- ``tokenizer_config.json`` + ``chat_template.jinja``: a Llama-3-style chat template that renders
  the system prompt, the tools (as JSON, with ``tojson``), every message (``tool_calls`` too) and
  the generation prompt, starting with ``bos_token``;
- ``config.json`` + ``model.safetensors``: a ``LlamaForCausalLM`` with 2 layers, hidden size 128,
  4 heads (head dim 32, which vLLM's CPU attention supports), random weights from seed 0.

Nothing depends on the clock or the machine: the same checkout builds the same files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

#: The words prompts are made of (tests/e2e/workload.py draws from the same list).
WORDS = (
    "cache prefix token block worker router engine prompt tenant request latency throughput "
    "memory eviction policy hash ring index session system user assistant tool call answer "
    "question context window attention layer model weight gradient batch queue schedule fleet "
    "gateway endpoint replica shard region zone cluster node pod container service metric trace "
    "event stream publisher subscriber socket message sequence replay restart failover health "
    "budget quota limit capacity utilisation load balance sticky consistent random locality "
    "the a an of to in on for with by from at as is are was were be been being and or but not "
    "this that these those it its we you they he she our your their one two three four five "
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omega north south east west "
    "red green blue yellow orange purple black white silver golden river mountain forest ocean"
).split()

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:\\n' }}
{%- for tool in tools %}
{{- tool | tojson }}
{{- '\\n' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- if message['content'] is string %}
{{- message['content'] | trim }}
{%- elif message['content'] %}
{%- for part in message['content'] %}
{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}
{%- endfor %}
{%- endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{{- '\\n<call>' + call.function.name + ' ' + (call.function.arguments | tojson) + '</call>' }}
{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 30))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ":", ","]))
    lines.append(json.dumps({"type": "function", "function": {"name": "get_weather"}}))
    return lines


def build_tokenizer(out: Path, vocab_size: int = 2048) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id(SPECIAL[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL[0]} $A", pair=f"{SPECIAL[0]} $A $B", special_tokens=[(SPECIAL[0], bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[4],
        "pad_token": SPECIAL[1],
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {
                "content": s,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for s in SPECIAL
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": SPECIAL[0], "eos_token": SPECIAL[4], "pad_token": SPECIAL[1]})
    )
    return tok.get_vocab_size()


def build_model(out: Path, vocab_size: int, bos: int, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen) + "\n")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    build_model(out, vocab, tok.token_to_id(SPECIAL[0]), tok.token_to_id(SPECIAL[4]))
    print(f"tiny llama in {out} (vocab {vocab})")


if __name__ == "__main__":
    main()
