# Sourced by the bench/device scripts: `rlx ppo` imports the HTTP server's packages, which the GPU image lacks; a
# carried .carry/http (uvicorn, starlette and their needs as wheels) is installed into /root/keep/http and put on the
# path, with this checkout. Unbuffered output, so a call cut by its time limit keeps what was printed.
export PYTHONUNBUFFERED=1
if [ -d .carry/http ]; then
  mkdir -p /root/keep/http && python3 -m pip install -q --no-index --no-deps --target /root/keep/http .carry/http/*.whl
  export PYTHONPATH=/root/keep/http:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
