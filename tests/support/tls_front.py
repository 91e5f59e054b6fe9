"""A TLS endpoint in front of a plain-TCP server: the collector of the OTLP
TLS tests, the API server of the in-cluster workload tests.

rotel, the tests' collector, receives OTLP without TLS only, and the
workload tests' API server is a plain HTTP one; this process terminates
TLS (Python's ssl, i.e. OpenSSL) with the certificate the test made and
passes the bytes on, so the agent speaks real TLS (ALPN h2 for gRPC,
http/1.1 for HTTP) to a real server behind it. What clients send
after the handshake is appended to LOG, so a test can find the HTTP
headers there.

    tls_front.py CERT KEY LOG LISTEN_PORT:UPSTREAM_PORT [...]

Prints "ready" once every port listens.
"""

import asyncio
import ssl
import sys


async def pipe(reader, writer, log=None):
    try:
        while data := await reader.read(65536):
            if log is not None:
                log.write(data)
                log.flush()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


async def main():
    cert, key, log_path, *pairs = sys.argv[1:]
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2", "http/1.1"])
    log = open(log_path, "ab")

    def serve(upstream):
        async def handle(client_reader, client_writer):
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
            except OSError:
                client_writer.close()
                return
            await asyncio.gather(pipe(client_reader, up_writer, log), pipe(up_reader, client_writer))

        return handle

    servers = []
    for pair in pairs:
        listen, upstream = (int(port) for port in pair.split(":"))
        servers.append(await asyncio.start_server(serve(upstream), "127.0.0.1", listen, ssl=context))
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


asyncio.run(main())
