import ast, os, sys
root = os.path.dirname(os.__file__)
mods = ["argparse","collections/__init__","csv","datetime","decimal" ,"difflib","email/message","fractions","functools","heapq","inspect","json/__init__","logging/__init__","pathlib","pickle","queue","random","shutil","statistics","string","subprocess","tarfile","textwrap","threading","typing","unittest/case","urllib/parse","zipfile/__init__" if os.path.isdir(os.path.join(root,"zipfile")) else "zipfile","asyncio/tasks","asyncio/events","contextlib","dataclasses","enum","abc","bisect","calendar","configparser","copy","fnmatch","gettext","glob","hashlib","ipaddress","locale","operator","optparse","os","pprint","shlex","smtplib","socket","tempfile","timeit","tokenize","trace","uuid","weakref","imaplib","ftplib","http/client","http/cookiejar","xml/dom/minidom","base64","codecs","doctest","pdb","pydoc","sched","selectors","signal","struct","sysconfig","traceback","turtle","warnings","wave","zipimport"]
out = []
seen=set()
for m in mods:
    path = os.path.join(root, m + ".py")
    if not os.path.exists(path) or path in seen: continue
    seen.add(path)
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 80 and doc.isascii():
                out.append(doc.strip())
text = "\n\n".join(out) + "\n"
sys.stdout.write(text)
print(len(text), len(out), file=sys.stderr)
