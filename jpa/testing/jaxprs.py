"""Reading traced programs in tests: every equation of a jaxpr, kernel bodies included."""


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs in its equations' parameters (scan / cond bodies, Pallas
    kernel bodies), depth first."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)
