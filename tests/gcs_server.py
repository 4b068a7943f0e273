"""The local GCS server of the gs:// tests: gcp-storage-emulator (pure Python, in memory) with the
one response header it lacks added. A media download from real GCS carries the object's
generation in ``x-goog-generation``; tensorstore (hence orbax) reads it to version what it caches
and fails with "Malformed StorageGeneration" without it, so every checkpoint read on the plain
emulator fails. Run as ``python tests/gcs_server.py PORT BUCKET``."""
import sys

from gcp_storage_emulator.handlers import objects

_download = objects.download


def download(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])
    except Exception:   # a missing object: the emulator's own handler answers 404
        pass
    return _download(request, response, storage, *args, **kwargs)


objects.download = download   # before the server module builds its routing table from it

if __name__ == "__main__":
    from gcp_storage_emulator.__main__ import main
    port, bucket = sys.argv[1], sys.argv[2]
    main(["start", "--host=localhost", f"--port={port}", "--in-memory", f"--default-bucket={bucket}"])
