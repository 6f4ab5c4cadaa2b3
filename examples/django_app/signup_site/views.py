"""``POST /subscribe {"email": ...}``: a row and its job in one ``transaction.atomic()``."""

import json

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse

from signup_site.jobs import awa


class Refused(Exception):
    pass


def subscribe(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return JsonResponse({"error": "use POST"}, status=405)
    email = json.loads(request.body)["email"]
    try:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO subscribers (email) VALUES (%s) RETURNING id", [email])
                subscriber_id = cur.fetchone()[0]
            # connection.connection is Django's psycopg 3 connection, inside the atomic block's
            # transaction: the job commits or rolls back with the row.
            job_id = awa.enqueue("send_confirmation", {"subscriber_id": subscriber_id}, conn=connection.connection)
            if email.endswith("@invalid.example"):
                raise Refused(email)
    except Refused:
        return JsonResponse({"error": "address refused"}, status=422)
    return JsonResponse({"subscriber_id": subscriber_id, "job_id": job_id}, status=201)
