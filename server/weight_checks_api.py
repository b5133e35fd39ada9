"""Weight checking routes of SGLang and slime's patched SGLang: `/weights_checker` (snapshot,
reset_tensors, compare, checksum; engine/core/checks.py has the rules) and `/post_process_weights`.

Rules:
- Answers are SGLang's: `{"success", "message"}` (checksum adds `ranks` and
  `per_engine_checksum`), 200 on success, 400 with `success: false` (and our `error` object)
  when a compare finds differences or the action cannot run.
- `/post_process_weights` exists in slime's SGLang patch to restore and re-quantize
  compressed-tensors weights around a sync. Weights here are never quantized, so there is nothing
  to restore or post-process: it validates its body and answers success, saying so. (A 501 would
  stop a slime run for no reason: slime sends it only for quantized models, which this server
  cannot load anyway.)
- Both need the admin key when the server has one (reset_tensors overwrites the weights).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from engine.core.calls import CheckWeights
from engine.errors import InvalidRequest
from server.errors import error_body

router = APIRouter()


class CheckWeightsIn(BaseModel):
    action: Literal["snapshot", "reset_tensors", "compare", "checksum"] = "checksum"
    allow_quant_error: bool = False  # no quantized weights here: comparisons are exact


class PostProcessWeightsIn(BaseModel):
    restore_weights_before_load: bool = False
    post_process_quantization: bool = False



@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request, body: CheckWeightsIn | None = None) -> JSONResponse:
    body = body or CheckWeightsIn()
    try:
        answer = await request.app.state.client.call(CheckWeights(**body.model_dump()))
    except InvalidRequest as e:
        return JSONResponse(error_body(e) | {"success": False, "message": str(e)}, status_code=400)
    return JSONResponse(answer)


@router.post("/post_process_weights")
async def post_process_weights(request: Request, body: PostProcessWeightsIn | None = None) -> dict[str, object]:
    body = body or PostProcessWeightsIn()
    done = [what for what, asked in (("restore weights before load", body.restore_weights_before_load),
                                     ("post-process quantization", body.post_process_quantization)) if asked]
    return {"success": True,
            "message": f"nothing to do for {' and '.join(done) or 'no step'}: weights are not quantized here"}
