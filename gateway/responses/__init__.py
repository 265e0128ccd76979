"""The OpenAI Responses API (``/v1/responses``), served through the chat pipeline, with its state
in Redis so that any gateway answers any call:

* ``models``: the request, the Response object, its items and stream events (the SDK's shapes);
* ``convert``: a Responses request (and the stored conversation it continues) → a chat request;
* ``render``: the pure renderer of a response's events and final object from its deltas;
* ``store``: stored responses in Redis (``sluice.wire.stored_response``);
* ``service`` / ``routes``: the endpoints.
"""
