"""Small helpers that drive an engine in tests."""


def drain(engine) -> dict:
    """Step ``engine`` until it has no work; each finished request's final output by id."""
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals
