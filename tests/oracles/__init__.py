"""Reference implementations the tests compare the package against, kept out of the package: the greedy
router of earlier versions (``greedy``), the first-fit schedule (``first_fit``), the step rule over the
objects (``pair_loads``), plan validation over the objects (``plan_check``) and the routing rule over the
objects (``route_objects``: ``route_box`` box by box)."""
