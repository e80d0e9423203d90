"""Reference implementations the tests compare the package against, kept out of the package: the greedy
router of earlier versions (``greedy``), the first-fit schedule (``first_fit``), the step rule over the
objects (``pair_loads``) and plan validation over the objects (``plan_check``)."""
