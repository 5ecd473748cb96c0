"""Three test modules, one `serve run`: test_openai_app, test_lora_serve and test_embeddings_serve
each test an application of tiny random-weight models, and conftest.py deploys the three
applications (apps.py) with one `serve run` for the whole package, as an operator puts several
applications in one deploy file. A start of Ray, Serve and an application is the larger part of
such a module's time on a 2-core machine; here it is paid once."""
