"""equinox modules: MultiheadAttention under jax.vmap."""

from .common import B, T, H, D, export_fn, jax_modules, spec, tname
from .registry import golden


@golden(rewritten=1, targets=[tname(32, "f32", False)], layout="(HD)BS")
def equinox_vmap_mha():
    # equinox MultiheadAttention under jax.vmap: the mapped batch sits in the middle of Q's
    # source; the report reads batch 2, heads 4 from the Q·K product's batching dims
    jax, jnp, _ = jax_modules()
    import equinox as eqx
    m = eqx.nn.MultiheadAttention(num_heads=H, query_size=H * D, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(m, eqx.is_array)

    def f(params, x):
        mm = eqx.combine(params, static)
        return jax.vmap(lambda xx: mm(xx, xx, xx))(x)
    return export_fn(f, jax.tree.map(lambda a: spec(a.shape, a.dtype), params),
                     spec((B, T, H * D)))
