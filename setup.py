from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini')
cfg = cfg['DEFAULT']

licenses = {'apache2': ('Apache Software License 2.0', 'OSI Approved :: Apache Software License')}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
# The Pythons CI tests: the second column of settings.ini's test_envs
py_versions = sorted({l.split()[1] for l in cfg['test_envs'].splitlines() if l.strip()}, key=lambda v: tuple(map(int, v.split('.'))))
lic = licenses[cfg['license']]
min_python = cfg['min_python']

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    license=lic[0],
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: Developers',
                 'License :: ' + lic[1],
                 'Natural Language :: ' + cfg['language']] +
                ['Programming Language :: Python :: ' + o for o in py_versions],
    url=f"https://github.com/{cfg['user']}/{cfg['repo']}",
    packages=setuptools.find_packages(include=[cfg['lib_name'], cfg['lib_name'] + '.*']),
    include_package_data=True,
    install_requires=cfg['requirements'].split(),
    extras_require={'dev': cfg['dev_requirements'].split()},
    python_requires='>=' + min_python,
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'nbdev': [f"{cfg['lib_name']}={cfg['lib_name']}._modidx:d"]},
    author=cfg['author'], author_email=cfg['author_email'],
    description=cfg['description'], keywords=cfg['keywords'],
)
