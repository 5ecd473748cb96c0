"""Two test modules, one `serve run`: test_anthropic (Anthropic's Messages API) and test_responses
(the Responses API and its store) drive one SmolLM2 application (server.py), started by conftest.py
for the whole package. The two ran near-identical servers before; a start of Ray, Serve and
SmolLM2 is a large part of such a module's time on a 2-core machine, and here it is paid once.
test_responses' last test restarts `serve run` on the same store: it runs last (module order)."""
