import contextlib, torch
from transformers import AutoModelForCausalLM
from rlx.logprobs import logprobs_from_logits
from rlx.models.exact import exact_forward
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
ids = torch.randint(3, config.vocab_size, (3, 40), device="cuda")
for padded in (False, True):
  mask = torch.ones_like(ids)
  if padded: mask[1, :9] = 0
  def run(exact, bf16=True, entropy=True):
    model.zero_grad()
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with ac, exact_forward(model) if exact else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask).logits
        logp, ent = logprobs_from_logits(logits[:, :-1], ids[:, 1:], 0.9, with_entropy=True)
        w = mask[:, 1:].float()
        loss = -((logp + (0.1 * ent if entropy else 0)) * w).sum() / w.sum()
    loss.backward()
    return float(loss), {n: p.grad.float().flatten().clone() for n, p in model.named_parameters()}
  for entropy in (True, False):
    ref = run(False, bf16=False, entropy=entropy); ex = run(True, entropy=entropy); de = run(False, entropy=entropy); ex32 = run(True, bf16=False, entropy=entropy)
    print(f"padded={padded} entropy={entropy} loss ref {ref[0]:.5f} exact {ex[0]:.5f} default {de[0]:.5f} exact32 {ex32[0]:.5f}")
    cos = lambda a, b: float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    worst = sorted(ref[1], key=lambda n: cos(ex[1][n], de[1][n]))[:6]
    for n in worst:
        print(f"  {n:45s} ex~de {cos(ex[1][n], de[1][n]):.4f} ex~ref {cos(ex[1][n], ref[1][n]):.4f} de~ref {cos(de[1][n], ref[1][n]):.4f} ex32~ref {cos(ex32[1][n], ref[1][n]):.6f}")
