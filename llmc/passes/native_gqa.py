"""Native GQA: attend with the K/V heads as stored instead of copies expanded to the query heads.

HF's `repeat_kv` exports as Unsqueeze(axis 2) -> Expand -> Reshape, materializing n_rep copies
of K and V per step. ONNX Attention (opset 23) does grouped-query attention itself when K/V
have fewer heads than Q, so the expansion can go.
"""

from __future__ import annotations

from llmc.passes.base import BuildContext, RewriteRule, RulePass, const_ints, producer


class DropKVExpansion(RewriteRule):
    name = "attention_gqa"

    def match(self, node, ctx: BuildContext):
        if node.op_type != "Attention" or len(node.inputs) < 3:
            return None
        chains = []
        for value in node.inputs[1:3]:
            reshape = producer(value, "Reshape")
            expand = producer(reshape.inputs[0], "Expand") if reshape else None
            unsqueeze = producer(expand.inputs[0], "Unsqueeze") if expand else None
            chains.append((reshape, expand, unsqueeze))
        if not any(c[2] for c in chains):
            return None  # no expansion at all (e.g. num_heads == num_kv_heads)
        return {"attention": node, "chains": chains}

    def check(self, m, ctx: BuildContext):
        spec = ctx.spec
        if spec.num_heads % spec.num_kv_heads:
            return f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
        for reshape, expand, unsqueeze in m["chains"]:
            if unsqueeze is None:
                return "only one of K/V is expanded"
            if const_ints(unsqueeze.inputs[1]) != [2]:
                return "expansion does not unsqueeze the head axis (axis 2)"
            source = unsqueeze.inputs[0]
            if source.shape is not None and len(source.shape) == 4 and source.shape[1] != spec.num_kv_heads:
                return f"K/V source has {source.shape[1]} heads, expected {spec.num_kv_heads}"
        return None

    def rewrite(self, m, ctx, model):
        attention = m["attention"]
        for slot, (_, _, unsqueeze) in zip((1, 2), m["chains"]):
            attention.replace_input_with(slot, unsqueeze.inputs[0])


class NativeGQA(RulePass):
    name = "native-gqa"
    description = "remove the K/V head expansion before Attention (ONNX Attention does GQA natively)"
    rules = (DropKVExpansion(),)

    def finish(self, model, ctx, counts):
        from llmc.passes.cleanup import remove_dead_code

        if counts:
            remove_dead_code(model)
