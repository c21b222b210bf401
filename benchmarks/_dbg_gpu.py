import sys, torch, traceback
sys.path.insert(0, ".")
from tests.adapters import families
from moe_overlap.adapters.transformers import TransformersMoEAdapter
for impl in ("default", "eager", "batched_mm"):
    for fam, cl in [("deepseek_v3", "DeepseekV3ForCausalLM")]:
        for dev, dt in [("cuda", torch.float32), ("cuda", torch.bfloat16)]:
            m = families.build(fam, cl).to(device=dev, dtype=dt)
            if impl != "default":
                m.config._experts_implementation = impl
            try:
                a = TransformersMoEAdapter(m)
                print(impl, fam, dev, dt, "OK")
            except Exception as e:
                print(impl, fam, dev, dt, "FAIL", str(e)[:300])
                if e.__cause__ is not None:
                    traceback.print_exception(e.__cause__)
